"""A forward-only pass over a rank's pipeline stages without their schedule (V placements).

On torch 2.13 a V schedule's `eval()` fails ("can't steal_bwd_input if this stage doesn't have
backward"). `forward_walk` visits (microbatch, stage) microbatch-major, an order every dependency
respects, so blocking receives and non-blocking sends cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage


def forward_walk(stages: list[PipelineStage], n_microbatches: int, inputs: torch.Tensor | None,
                 labels: torch.Tensor | None, positions: torch.Tensor | None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 activation: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """`loss_fn(logits, labels)` of each microbatch where this rank runs the last stage, else [].

    `activation` (e.g. on `meta`) gives the shape and dtype one stage hands the next."""
    mine = {s.stage_index: s for s in stages}
    split = lambda t: t.tensor_split(n_microbatches) if t is not None else None  # noqa: E731
    ids, targets, pos = split(inputs), split(labels), split(positions)
    local: dict[int, torch.Tensor] = {}  # stage index -> its output, for the next local stage
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    losses = []
    for mb in range(n_microbatches):
        for index in sorted(mine):
            stage = mine[index]
            if stage.is_first:
                x = ids[mb]
            elif index - 1 in mine:
                x = local.pop(index - 1)
            else:
                x = torch.empty_like(activation, device=stage.device)
                src = stage.stage_index_to_group_rank[index - 1]
                dist.recv(x, group=stage.group, group_src=src)
            kwargs = {"positions": pos[mb]} if pos is not None else {}
            out = stage.submod(x, **kwargs)
            if stage.is_last:
                losses.append(loss_fn(out, targets[mb]))
            elif index + 1 in mine:
                local[index] = out
            else:
                out = out.to(activation.dtype).contiguous()
                dst = stage.stage_index_to_group_rank[index + 1]
                sends.append((dist.isend(out, group=stage.group, group_dst=dst), out))
    for work, _ in sends:
        work.wait()
    return losses
