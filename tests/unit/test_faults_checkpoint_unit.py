"""The fault suite, part 1 (forked ranks, one process group): what a long run does when the
numbers, the checkpoints folder or the disk go wrong. Each test reproduces one row of the table
in docs/faults.md and asserts the message, and that nothing was lost or poisoned.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_faults_checkpoint.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh3d.errors import UserError


def test_damaged_random_state_file_is_named():
    from mesh3d.checkpoint import load, nanotron_state

    states = nanotron_state.random_states()
    states["python"]["state"] = torch.tensor([2**70 // 2**10] * 3, dtype=torch.float64)
    with pytest.raises(UserError, match="random-state file r.pt is damaged .*delete it"):
        load.set_random_states(states, Path("r.pt"))


def test_the_non_finite_line_shows_the_losses_before_it(tmp_path):
    # a loss that rose before the NaN may already be in the checkpoint the line names: show it
    import copy

    from parity import TINY

    from mesh3d.config import config_from_dict
    from mesh3d.errors import NonFiniteError
    from mesh3d.train.guard import RunGuard

    raw = copy.deepcopy(TINY)
    raw["checkpoints"] = {"checkpoints_path": str(tmp_path), "checkpoint_interval": 1}
    guard = RunGuard.__new__(RunGuard)  # the step verdict only: no process group needed
    guard.cfg, guard.skipped, guard.losses = config_from_dict(raw), 0, []
    for step, loss in enumerate([6.3, 6.1, 410.0, 1.5e6], start=1):
        assert guard.check_finite(step, loss, 1.0)
    with pytest.raises(NonFiniteError) as e:
        guard.check_finite(5, float("nan"), float("nan"))
    assert "The loss before it (step: lm_loss) was 2: 6.1, 3: 410, 4: 1.5e+06; if it was already " \
        "rising, that checkpoint may hold diverging weights: resume from an earlier one." in str(e.value)  # fmt: skip
