"""Tensor parallelism as data: a plan `FQN pattern -> ParallelStyle`, applied on mesh["tp"].

The model file stays single-device; a family's spec (`models/<family>_spec.py`) holds its plan,
Megatron-style as Nanotron's TP modes (spec §6.3). This file has what every plan uses:
`apply_tp`, the styles the plans use (`LocalColwise` / `LocalRowwise` / `LocalReplicated`:
torch's layouts, computed on local tensors inside a block), `block_input` (one gathered input
per attention / MLP block), and the gradient fix-ups after backward.

Every parameter ends up a DTensor on the tp mesh (replicated ones as `Replicate()`), which keeps
foreach AdamW and gradient clipping working (FACTS.md: mixed plain + DTensor parameters break).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,  # noqa: F401  (re-exported: a family's spec writes its tp plan from this module)
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from mesh3d.parallel.experts import summed_over

TPPlan = dict[str, ParallelStyle]


class LocalReplicated(ParallelStyle):
    """Keep a module's weights as `Replicate()` DTensors and run it on local tensors.

    For the norms, and for an MoE block (`ExpertsReplicated`). The module reads its weights
    through `to_local(grad_placements=[module.grad_placement])` (RMSNorm and the MoE block
    honour `grad_placement`), so its interior is plain tensor code, not one DTensor dispatch per
    op. The weight gradient is `Replicate()` when every tp rank computes the same thing (ALL_REDUCE
    activations: the column-parallel consumers all-reduce their input gradient), `Partial()` when
    each rank holds other rows (sequence parallelism; the Qwen3 q/k norms on each rank's heads),
    summed once after backward by `reduce_partial_grads`. Inputs arrive local (a DTensor is
    made local); the output is local.
    """

    def __init__(self, partial_grads: bool):
        super().__init__()
        self.partial_grads = partial_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_params(_name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p, mesh, [Replicate()], src_data_rank=None)
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        module.grad_placement = Partial() if self.partial_grads else Replicate()

        def to_local(_mod, inputs, mesh):
            return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)

        return distribute_module(module, device_mesh, replicate_params, input_fn=to_local)


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
        return super()._apply(module, device_mesh)


def _local_colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.to_local()
    return F.linear(x, self.weight.to_local(), bias)


class LocalColwise(ColwiseParallel):
    """`ColwiseParallel`'s layout (weight and bias `Shard(0)`), computed on local tensors.

    The input is the block's local copy of the full activations (`block_input`), the output
    this rank's columns, local. The same math as `ColwiseParallel` fed a `Replicate()` input,
    with one `to_local` per parameter instead of DTensor's dispatch of each op of the linear
    and its backward; the weight gradient arrives as a `Shard(0)` DTensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.forward = types.MethodType(_local_colwise_forward, module)
        return module


class LocalRowwise(RowwiseParallel):
    """`RowwiseParallel`'s layout (weight `Shard(1)`, bias `Replicate()`), computed on local
    tensors: this rank's partial product of its input columns, then one reduction to
    `output_layouts` (all-reduce to `Replicate()`, reduce-scatter to `Shard(1)` under sequence
    parallelism) and the bias; the output is local."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition_linear_fn)
        layout = self.output_layouts[0]
        bias_grad = [Partial() if layout.is_shard() else Replicate()]

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(F.linear(x, mod.weight.to_local()), device_mesh,
                                         [Partial()], run_check=False)  # fmt: skip
            out = partial.redistribute(device_mesh, [layout]).to_local()
            if mod.bias is not None:
                out = out + mod.bias.to_local(grad_placements=bias_grad)
            return out

        module.forward = types.MethodType(forward, module)
        return module


class _BlockInput(ParallelStyle):
    """`block_input`'s style: a forward pre-hook on the block."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_mod, inputs):
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.layout], run_check=False)
            full = x.redistribute(device_mesh, [Replicate()])
            return (full.to_local(grad_placements=[Partial()]), *rest)

        module.register_forward_pre_hook(gather)
        return module


def block_input(layout) -> ParallelStyle:
    """Hand attention / MLP their input as one local copy of the full activations (gathered
    from `layout`: all-gathered under sequence parallelism, as is under ALL_REDUCE).

    q/k/v (and gate/up, `LocalColwise`) then share it: their input-gradient contributions add up
    locally, as plain tensors, and are reduced once per sublayer on the way back (the gradient
    leaves as `Partial()`: one all-reduce, or one reduce-scatter under sequence parallelism),
    not once per projection.
    """
    return _BlockInput(layout)


def shard_grads_like_params(model: nn.Module) -> None:
    """Give every tp-sharded parameter its gradient in the parameter's own layout.

    DTensor's embedding backward returns the vocab-parallel embedding's gradient as
    `Replicate()`, the full padded [V, h] on every tp rank, while the weight is `Shard(0)`.
    Accumulated like that it holds tp times the memory, and zero 0's dp all-reduce sends tp
    times the bytes. A hook lays each incoming gradient out like its parameter before it is
    accumulated (Replicate -> Shard is a local slice: no communication). FSDP replaces the
    parameters, so these hooks then never fire; it lays gradients out itself.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            p.register_hook(functools.partial(_laid_out_as, tuple(p.placements)))


def _laid_out_as(placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    if (
        isinstance(grad, DTensor)
        and tuple(grad.placements) != placements
        and not any(isinstance(pl, Partial) for pl in grad.placements)  # those need a reduction
    ):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def reduce_partial_grads(params) -> None:
    """Turn `Partial` gradients (norm weights under sequence parallelism) into `Replicate` ones.

    DTensor leaves them partial after backward and would reduce them again each time they are
    read (clipping once, AdamW three times). One flat all-reduce per (mesh, placements) group
    right after backward does it once.
    """
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(p)
    for (mesh, placements), ps in groups.items():
        locals_ = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if isinstance(pl, Partial):
                torch.distributed.all_reduce(flat, group=mesh.get_group(dim))
        done = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
        offset = 0
        for p, t in zip(ps, locals_):
            local = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(
                local, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Apply `plan` (`FQN pattern -> ParallelStyle`, `*` matching one name) to any `model` in
    place, on meta or real tensors, without communication: every rank keeps its slice of the
    full tensors it holds (`src_data_rank=None`), so build the full model from the same seed on
    every rank first.

    Example:


        apply_tp(model, mesh["tp"], {"h.*.mlp.fc": ColwiseParallel(), "h.*.mlp.proj": RowwiseParallel()})

    Plan entries whose module a pipeline stage deleted (None) are skipped. Tied embeddings are
    re-tied afterwards: parallelizing the embedding and the head separately would otherwise
    give them two different parameters.
    """
    tied = getattr(model, "lm_head", None) is not None and (
        getattr(model, "embed_tokens", None) is not None
        and model.lm_head.weight is model.embed_tokens.weight
    )
    present = {k: v for k, v in plan.items() if _resolves(model, k)}
    parallelize_module(model, tp_mesh, present, src_data_rank=None)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _resolves(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` (fnmatch per dotted token) names at least one existing submodule."""
    from fnmatch import fnmatch

    tokens = pattern.split(".")
    for name, mod in model.named_modules():
        parts = name.split(".") if name else []
        if mod is not None and len(parts) == len(tokens) and all(map(fnmatch, parts, tokens)):
            return True
    return False
