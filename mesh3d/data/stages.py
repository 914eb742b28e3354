"""Data stages (Nanotron's `data_stages`): which one is active at a step, and what it consumed.

Every step consumes one global batch from the active stage, so both follow from the step alone.
"""

from __future__ import annotations


def stage_index_at(starts: list[int], step: int) -> int:
    """Index of the stage active at `step` (1-based), given each stage's start step in order."""
    return max((i for i, start in enumerate(starts) if start <= step), default=0)


def consumed_in_stage(
    starts: list[int], step: int, global_batch_size: int, resumed: tuple[int, int] | None = None
) -> int:
    """Samples the stage active at `step` consumed in the steps before it. `resumed`: (step,
    samples) of the checkpoint, whose steps count at its own batch size (dp may have changed)."""
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
