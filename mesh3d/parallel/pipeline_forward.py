"""A forward-only pass over a rank's pipeline stages without their schedule (V placements).

Evaluation normally runs the training schedule in torch's forward-only mode
(`_PipelineSchedule.eval()`, `run_schedule(..., forward_only=True)`): the schedule's own action
list with the backward actions skipped. On torch 2.13 that fails for the V schedules
(`zbv_zero_bubble`, `dualpipev`): their list hands a backward from one of a rank's stages to the
other locally, which asserts outside training ("can't steal_bwd_input if this stage doesn't have
backward"). `forward_walk` is the way around it: every rank visits (microbatch, stage) in the
order microbatch-major, stage-minor, which every dependency respects (stage s of microbatch m
needs only stage s - 1 of m), so blocking receives and non-blocking sends cannot deadlock and
ranks still overlap on different microbatches. A stage's input comes from the previous stage:
locally when this rank runs it too, else received on the stages' pp group from the rank the
schedule placed it on (`stage.stage_index_to_group_rank`), into a buffer of the known
activation shape. The stages' modules are called directly, so the schedule's state (its
buffers for training) is untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage


def forward_walk(
    stages: list[PipelineStage],
    n_microbatches: int,
    inputs: torch.Tensor | None,
    labels: torch.Tensor | None,
    positions: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation: torch.Tensor,
) -> list[torch.Tensor]:
    """`loss_fn(logits, labels)` of each microbatch where this rank runs the last stage, else [].

    `inputs` / `labels` / `positions` [n·mbs, S] as for `run_schedule` (inputs where this rank
    runs stage 0, labels where it runs the last stage, positions, if any, everywhere);
    `activation` (e.g. on `meta`) gives the shape and dtype of what one stage hands the next
    for one microbatch. Call under `torch.no_grad()`.
    """
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
