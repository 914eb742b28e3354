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
