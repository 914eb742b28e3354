"""The ParallelStyles only some families' tensor-parallel plans use, beside `tp_styles.py`.

`ExpertsReplicated` (an MoE block: Qwen2/Qwen3 with a moe_config), `RankAware` (a dropout
module that needs its tp rank: Starcoder2) and Mamba's two (`LocalChannels`,
`LocalRowwiseShared`) are imported by those families' specs when they build a plan, so a plain
Llama run never loads them, and the model files stay single-device (no file under
`mesh3d/models/` imports torch.distributed).

Mamba's scan runs per channel: each tp rank holds a share of d_inner. `LocalChannels` splits the
tensors the mixer reads itself (A_log, D, conv1d) on their channels; `LocalRowwiseShared` sums
x_proj's partial products (dt, B, C) to every rank and, since each rank's scan uses them for its
own channels only, sums their gradient back over tp.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.torch_private import apply_style, parameter_slots
from mesh3d.tp_styles import (
    LocalReplicated,
    LocalRowwise,
    block_input,
    gather_full,
    local_of,
    summed_over,
)


class ExpertsReplicated(LocalReplicated):
    """A mixture-of-experts block under tensor parallelism: router, experts and shared expert
    replicated (`Replicate()` DTensor weights, the same on every tp rank), run on the tokens
    the rank holds, with local tensors inside.

    ALL_REDUCE: the rank holds every token (activations are replicated), so every tp rank
    computes the same thing and the same weight gradients. REDUCE_SCATTER: the rank holds its
    sequence shard and runs the experts on it alone (the block is per token: no gather); the
    weight gradients are partial sums over tp (`Partial()`, reduced once after backward by
    `reduce_partial_grads`), and the block sums its load-balancing statistics over tp. The
    block reads the mode from `grad_placement` and `sequence_sums`.
    """

    def __init__(self, sequence_parallel: bool):
        super().__init__(partial_grads=sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.partial_grads:
            module.sequence_sums.append(summed_over(device_mesh.get_group()))
        return apply_style(super(), module, device_mesh)


class RankAware(ParallelStyle):
    """Tell a module without parameters its rank on the tp mesh (`module.tp_rank`): a dropout
    that draws each value's mask from the value's global index finds the offset of its heads,
    or of its sequence shard under sequence parallelism (`models/dropout.py`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_rank = device_mesh.get_local_rank()
        return module


class LocalRowwiseShared(LocalRowwise):
    """`LocalRowwise` with its output all-reduced to `Replicate()` for channel-sharded readers:
    the gradient coming back is each rank's share too (Mamba's x_proj, whose dt, B and C feed
    the scan of this rank's channels only), so it is summed over tp on the way back."""

    def __init__(self):
        super().__init__(output_layouts=Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        apply_style(super(), module, device_mesh)
        rowwise = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            return gather_full(rowwise(x), device_mesh.get_group(), Replicate())

        module.forward = forward
        return module


class LocalChannels(ParallelStyle):
    """A block whose own tensors are split over tp on dim 0 (its channels) and read by its
    forward directly: Mamba's mixer reads `A_log`, `D` and `conv1d`'s weight and bias. Each
    named parameter becomes a `Shard(0)` DTensor, and during the block's forward the block
    sees this rank's rows as plain tensors (`local_of`: the gradient arrives `Shard(0)`). The
    block's input is handed to it as `block_input(input_layout)` does. Its submodules take
    their own styles (in_proj `LocalColwise`, ...)."""

    def __init__(self, input_layout, names: tuple[str, ...]):
        super().__init__()
        self.input_layout, self.names = input_layout, names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slots = []
        for name in self.names:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            p = parameter_slots(owner).get(leaf)
            if p is None:
                continue
            dt = distribute_tensor(p, device_mesh, [Shard(0)], src_data_rank=None)
            owner.register_parameter(leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
            slots.append((owner, leaf))
        apply_style(block_input(self.input_layout), module, device_mesh)
        inner = module.forward

        def forward(*args, **kwargs):
            held = [(parameter_slots(owner), leaf) for owner, leaf in slots]
            held = [(params, leaf, params[leaf]) for params, leaf in held]
            try:
                for params, leaf, p in held:
                    params[leaf] = local_of(p)
                return inner(*args, **kwargs)
            finally:
                for params, leaf, p in held:
                    params[leaf] = p

        module.forward = forward
        return module
