"""A streamed stage's bad data, reported once: every rank learns whether any rank's read of
the step failed, and all raise the error of the lowest such rank, printed by rank 0 alone.

A streamed stage reads its rows while training (`data/streaming.py`), so a bad row is found
on the one dp rank whose shard holds it, or on several at once; without this step its line
was printed once per rank, or a peer stopped on a dead collective. The check costs one
one-element all-reduce a step, on streamed stages only (map-style data is checked whole
before the first collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mesh3d.errors import UserError, on_every_rank


def agree_on_data_error(error: UserError | None, device: torch.device) -> None:
    """Every rank calls it after reading a streamed step: raise on every rank the error of the
    lowest rank that hit one (`error`: this rank's, or None), marked as everyone's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    world = dist.get_world_size()
    first = torch.tensor([world if error is None else dist.get_rank()], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return
    text = [str(error) if error is not None else None]
    dist.broadcast_object_list(text, src=src, device=device)
    raise on_every_rank(UserError(text[0])) from None
