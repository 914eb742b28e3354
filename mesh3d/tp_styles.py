"""The ParallelStyles a family's tensor-parallel plan is written in, and torch's own.

This module sits below the models so that their specs can name these styles. The `Local*`
styles keep torch's layouts but compute on local tensors inside a block; `block_input` hands a
block one gathered copy of its input. Every parameter ends up a DTensor on the tp mesh: mixed
plain and DTensor parameters would break foreach AdamW and gradient clipping.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (  # noqa: F401  (Shard re-exported for the specs)
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from mesh3d import extensions
from mesh3d.torch_private import apply_style, partition_fn
from mesh3d.tp_local import local_of

TPPlan = dict[str, ParallelStyle]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.11 has only those
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class LocalReplicated(ParallelStyle):
    """Keep a module's weights as `Replicate()` DTensors and run it on local tensors.

    The module reads its weights with `local_of(w, module.grad_placement)`: `Partial()` with
    `partial_grads` (each rank holds other rows; `reduce_partial_grads` sums them), else
    `Replicate()`."""

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


def _local_colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else local_of(self.bias)
    return F.linear(x, local_of(self.weight), bias)


class LocalColwise(ColwiseParallel):
    """`ColwiseParallel`'s layout (weight and bias `Shard(0)`), computed on local tensors: the
    input is the block's full activations (`block_input`), the output this rank's columns."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn(self, "linear"))
        module.forward = types.MethodType(_local_colwise_forward, module)
        return module


class LocalRowwise(RowwiseParallel):
    """`RowwiseParallel`'s layout (weight `Shard(1)`, bias `Replicate()`), computed on local
    tensors: this rank's partial product, one reduction to `output_layouts`, then the bias."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn(self, "linear"))
        layout = self.output_layouts[0]
        bias_grad = Partial() if layout.is_shard() else Replicate()

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x, local_of(mod.weight))
            term = getattr(mod, "partial_term", None)  # a LoRA adapter's share (models/lora.py)
            if term is not None:
                y = y + term(x)
            out = _reduced(y, device_mesh, layout)
            if mod.bias is not None:
                out = out + local_of(mod.bias, bias_grad)
            return out

        module.forward = types.MethodType(forward, module)
        return module


class LocalEmbedding(RowwiseParallel):
    """`RowwiseParallel`'s vocab-parallel embedding (weight `Shard(0)`), computed on local
    tensors: each rank looks up the ids in its rows (others give zeros), then one reduction to
    `output_layouts`. Shards are `torch.chunk`'s (the last may be shorter), as `Shard(0)`'s."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn(self, "embedding"))
        layout = self.output_layouts[0]
        rows = -(-module.weight.shape[0] // device_mesh.size())
        start = min(device_mesh.get_local_rank() * rows, module.weight.shape[0])

        def forward(mod: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            w = local_of(mod.weight)
            outside = (ids < start) | (ids >= start + w.shape[0])
            y = F.embedding((ids - start).masked_fill(outside, 0), w)
            y = y.masked_fill(outside.unsqueeze(-1), 0.0)
            return _reduced(y, device_mesh, layout)

        module.forward = types.MethodType(forward, module)
        return module


# The activations' collectives on plain tensors (eager mode): what DTensor's `redistribute` does,
# without its per-call Python. Compiled code keeps DTensor's traceable path; the math is the same.


class C10dCollectives:
    """A TP group's activation collectives as c10d calls, on dim 0 of contiguous tensors."""

    @staticmethod
    def gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """Every rank's `x` along dim 0, in rank order."""
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        all_gather_flat(out, x, group=group)
        return out

    @staticmethod
    def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The sum of every rank's `x`, this rank's shard of dim 0."""
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        reduce_scatter_flat(out, x, group=group)
        return out

    @staticmethod
    def summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The sum of every rank's `x`."""
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out


C10D = C10dCollectives()
_CHOSEN: dict[dist.ProcessGroup, object] = {}  # TP group -> its collectives (default C10D)


def choose_collectives(group: dist.ProcessGroup, device_type: str) -> None:
    """Fix the activation collectives of TP group `group`: a pair of CPU ranks trades tensors
    (`parallel/pair_collectives.py`); any other group, or one never chosen, uses c10d's."""
    pair = device_type == "cpu" and dist.get_world_size(group) == 2
    pairs = extensions.load("pair_collectives").PairCollectives if pair else None
    _CHOSEN[group] = pairs(dist.get_rank(group)) if pairs else C10D


def _seq_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather `x` along `dim` (equal shards, in rank order)."""
    out = _CHOSEN.get(group, C10D).gather(x.movedim(dim, 0).contiguous(), group)
    return out.movedim(0, dim).contiguous()


def _seq_reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over `group` and keep this rank's shard along `dim`."""
    out = _CHOSEN.get(group, C10D).reduce_scatter(x.movedim(dim, 0).contiguous(), group)
    return out.movedim(0, dim).contiguous()


def _summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous(memory_format=torch.contiguous_format)
    return _CHOSEN.get(group, C10D).summed(x, group)


class _ReduceToLayout(torch.autograd.Function):
    """Forward: partial sums -> `Replicate()` (all-reduce) or sequence shards (reduce-scatter on
    `dim`); backward: the gradient as is, or all-gathered on `dim`."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _summed(x, group) if dim is None else _seq_reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.dim is None else _seq_gather(grad, ctx.dim, ctx.group)), None, None


class _GatherFromLayout(torch.autograd.Function):
    """Forward: `Replicate()` input as is, or sequence shards all-gathered on `dim`; backward:
    the block's partial input gradient summed over tp (all-reduce, or reduce-scatter on `dim`)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.view_as(x) if dim is None else _seq_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        g, dim = ctx.group, ctx.dim
        return (_summed(grad, g) if dim is None else _seq_reduce_scatter(grad, dim, g)), None, None


def _shard_dim(layout, ndim: int) -> int | None:
    """The sequence dim of a `Shard(d)` layout (non-negative), None for `Replicate()`."""
    if isinstance(layout, Replicate):
        return None
    if not isinstance(layout, Shard):
        raise ValueError(f"activation layout must be Replicate() or Shard(d), got {layout}")
    return layout.dim % ndim


def reduce_partial(x: torch.Tensor, group: dist.ProcessGroup, layout) -> torch.Tensor:
    """This rank's partial sum `x` (a row-parallel product) reduced to `layout`: the sum on every
    rank for `Replicate()`, this rank's shard of it for `Shard(d)`; a plain tensor."""
    return _ReduceToLayout.apply(x, group, _shard_dim(layout, x.dim()))


def gather_full(x: torch.Tensor, group: dist.ProcessGroup, layout) -> torch.Tensor:
    """The full activations from this rank's `x` in `layout` (as is for `Replicate()`, gathered
    for `Shard(d)`), whose gradient leaves summed over the group in `layout`."""
    return _GatherFromLayout.apply(x, group, _shard_dim(layout, x.dim()))


def _reduced(y: torch.Tensor, device_mesh: DeviceMesh, layout) -> torch.Tensor:
    """`reduce_partial` of `y` on `device_mesh`; in compiled code, DTensor's traceable path."""
    if torch.compiler.is_compiling():
        partial = DTensor.from_local(y, device_mesh, [Partial()], run_check=False)
        return partial.redistribute(device_mesh, [layout]).to_local()
    return reduce_partial(y, device_mesh.get_group(), layout)


class _BlockInput(ParallelStyle):
    """`block_input`'s style: a forward pre-hook on the block."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_mod, inputs):
            x, *rest = inputs
            if not isinstance(x, DTensor) and not torch.compiler.is_compiling():
                return (gather_full(x, device_mesh.get_group(), self.layout), *rest)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.layout], run_check=False)
            full = x.redistribute(device_mesh, [Replicate()])
            return (full.to_local(grad_placements=[Partial()]), *rest)

        module.register_forward_pre_hook(gather)
        return module


class LocalHead(ColwiseParallel):
    """`ColwiseParallel`'s vocab-parallel head (weight `Shard(0)`) on local tensors: its input
    is gathered from `input_layout` as a block's is (`block_input`), and this rank's vocabulary
    columns are returned as the `Shard(-1)` DTensor the vocab-parallel loss reads."""

    def __init__(self, input_layout):
        super().__init__(input_layouts=input_layout, output_layouts=Shard(-1),
                         use_local_output=False)  # fmt: skip

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn(self, "linear"))
        apply_style(_BlockInput(self.input_layouts[0]), module, device_mesh)
        vocab = module.weight.shape[0]

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            y = _local_colwise_forward(mod, x)
            shape = torch.Size((*y.shape[:-1], vocab))
            stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
            return DTensor.from_local(y, device_mesh, [Shard(-1)], run_check=False, shape=shape,
                                      stride=stride)  # fmt: skip

        module.forward = types.MethodType(forward, module)
        return module


def block_input(layout) -> ParallelStyle:
    """Hand attention / MLP one local copy of the full activations (gathered from `layout`):
    the projections' input gradients add up locally and are reduced once per sublayer."""
    return _BlockInput(layout)


def summed_over(group: dist.ProcessGroup):
    """`f(t)`: all-reduce `t` (a sum) over `group` in place and return the group's size."""

    def f(t: torch.Tensor) -> int:
        dist.all_reduce(t, group=group)
        return dist.get_world_size(group)

    return f
