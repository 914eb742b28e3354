"""The ParallelStyles only some families' tensor-parallel plans use, beside `tp_styles.py`.

`ExpertsReplicated` (an MoE block: Qwen2/Qwen3 with a moe_config) and `RankAware` (a dropout
module that needs its tp rank: Starcoder2) are imported by those families' specs when they
build a plan, so a plain Llama run never loads them, and the model files stay single-device.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.torch_private import apply_style
from mesh3d.tp_styles import LocalReplicated, summed_over


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
