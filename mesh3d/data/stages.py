"""Data stages (Nanotron's `data_stages`): which one is active at a step.

The stage active at step s is the last one (by `start_training_step`) that starts at or before
s. Every step consumes one global batch from the active stage; each stage reads its dataset
from its own beginning, offset by what it has consumed so far. Both counts follow from the step
alone, so a resumed run (at any layout) continues each stage exactly where it stopped.
"""

from __future__ import annotations


def stage_index_at(starts: list[int], step: int) -> int:
    """Index of the stage active at `step` (1-based), given each stage's start step in order."""
    active = 0
    for i, start in enumerate(starts):
        if start <= step:
            active = i
    return active


def consumed_in_stage(
    starts: list[int], step: int, global_batch_size: int, resumed: tuple[int, int] | None = None
) -> int:
    """Samples the stage active at `step` consumed in the steps before it. `resumed` = (step,
    samples) of the checkpoint a run resumed from: steps up to it count at the batch size the
    checkpoint's run had (samples / step), which differs when dp changed."""
    i = stage_index_at(starts, step)
    begin = max(starts[i], 1)
    before = max(step - begin, 0)
    if not resumed or not resumed[0]:
        return before * global_batch_size
    old = min(before, max(resumed[0] - begin + 1, 0))  # stage steps the checkpoint's run did
    return old * (resumed[1] // resumed[0]) + (before - old) * global_batch_size


def stage_consumption(starts: list[int], last_step: int, global_batch_size: int) -> list[int]:
    """Samples each stage consumed in steps 1..`last_step` (Nanotron's per-stage metadata)."""
    counts = [0] * len(starts)
    for step in range(1, last_step + 1):
        counts[stage_index_at(starts, step)] += global_batch_size
    return counts
