"""Checks of `mesh3d.loss_spike`, the loss-spike guard; part of `validate` (no torch import)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.schema import Config

KEY = "mesh3d.loss_spike"
MAX_WINDOW = 100_000  # steps: the running median is taken over them at every step


def loss_spike_errors(cfg: Config) -> Iterator[str]:
    """`factor`, `window`, `warmup` and `max_skipped` in their ranges."""
    spike = cfg.mesh3d.loss_spike
    if spike is None:
        return
    if not (math.isfinite(spike.factor) and spike.factor > 1):
        yield (
            f"`{KEY}.factor` must be a finite number > 1 (a spike is a loss or gradient norm "
            f"above factor x the running median), got {spike.factor}"
        )
    if spike.window < 1:
        yield f"`{KEY}.window` must be >= 1 (healthy steps in the running median), got {spike.window}"
    elif spike.window > MAX_WINDOW:
        yield (
            f"`{KEY}.window` ({spike.window}) must be at most {MAX_WINDOW} (the median of that "
            "many steps is taken at every step); lower it"
        )
    elif not 1 <= spike.warmup <= spike.window:
        yield (
            f"`{KEY}.warmup` ({spike.warmup}) must be in [1, window ({spike.window})]: the "
            "healthy steps seen before a step can count as a spike"
        )
    if spike.max_skipped < 0:
        yield (
            f"`{KEY}.max_skipped` must be >= 0 (spiking steps in a row skipped before the run "
            f"stops; 0 stops at the first), got {spike.max_skipped}"
        )
