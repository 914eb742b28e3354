"""Data parallelism on the mesh's "dp" axis (zero_stage 0): one flat all-reduce of gradients.

The loss is already normalized by the global token count (mesh3d/train/loss.py), so a SUM (not
an average) gives exactly the one-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mesh3d.torch_private import flatten_dense_tensors, unflatten_dense_tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def allreduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every parameter gradient over `group` in one flat all-reduce, except expert slices.

    Example:

        loss.backward()
        mesh3d.allreduce_gradients(model, mesh["dp"].get_group())
        optimizer.step()
    """
    if group is None:  # torch's None is every rank: tp/pp ranks would be summed in too
        raise TypeError("allreduce_gradients needs the data-parallel group, mesh['dp'].get_group()")
    params = [p for p in model.parameters() if getattr(p, "expert_shard", None) is None]
    allreduce_param_grads(params, group)


@torch.no_grad()
def allreduce_param_grads(params, group: dist.ProcessGroup) -> None:
    """Sum the gradients of `params` over `group` in one flat all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
