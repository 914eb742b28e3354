"""A tensor-parallel weight read as a local tensor: DTensor's `to_local`, with less per-call work.

Models call `local_of` on the weights tensor parallelism made DTensors; a plain tensor (no tp)
comes back as is, so a one-process run never loads the tp styles (`tp_styles.py`)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from mesh3d.torch_private import dtensor_spec, local_tensor


class _LocalOf(torch.autograd.Function):
    """`p.to_local()` of a contiguous DTensor parameter whose gradient keeps its placements;
    backward wraps the local gradient in a copy of the parameter's spec, skipping `to_local`'s
    per-call `from_local`."""

    @staticmethod
    def forward(ctx, p):
        ctx.spec = dtensor_spec(p)
        ctx.set_materialize_grads(False)
        local = local_tensor(p)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None
        grad = grad.contiguous()  # the spec's strides are the contiguous ones (`local_of`)
        return DTensor(grad, copy.copy(ctx.spec), requires_grad=grad.requires_grad)


def local_of(p: torch.Tensor, grad_placement=None) -> torch.Tensor:
    """`p.to_local(grad_placements=[grad_placement])` (`None`: the gradient keeps `p`'s
    placements), by the faster `_LocalOf` where it can; a plain tensor is returned as is."""
    if not isinstance(p, DTensor):
        return p
    same = grad_placement is None or (len(p.placements) == 1 and p.placements[0] == grad_placement)
    if same and p.is_contiguous() and not torch.compiler.is_compiling():
        return _LocalOf.apply(p)
    return p.to_local(grad_placements=None if grad_placement is None else [grad_placement])
