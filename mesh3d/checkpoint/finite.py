"""The NaN/inf check every saved tensor passes: a checkpoint never holds a non-finite value."""

from __future__ import annotations

import torch


def non_finite(t: torch.Tensor) -> int:
    """How many NaN/inf values `t` holds (0 for a non-float tensor). One pass: a sum is
    finite whenever every value is (NaN and inf propagate); only a non-finite sum, which an
    overflow of huge finite values can also give, is counted exactly."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.float64))):
        return 0
    return int((~torch.isfinite(t)).sum())
