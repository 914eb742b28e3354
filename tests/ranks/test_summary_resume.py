"""The summary printed at the end of a run speaks of that run: after a resume it counts the steps
this run ran, says where it resumed from, and names the checkpoint this run saved last (or none
when it saved none), not the one it resumed from (issue 26)."""

from __future__ import annotations

import contextlib
import copy
import io

from dist import run_ranks
from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.summary import finish
from mesh3d.train.loop import train


def _summary(overrides: list[str]) -> str:
    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
    result = train(cfg)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        finish(cfg, result, None)
    return out.getvalue()


def _runs(rank: int, world: int, root) -> list[str]:
    a, b = root / "a", root / "b"
    return [
        _summary(["tokens.train_steps=2", f"checkpoints.checkpoints_path={a}",
                  "checkpoints.checkpoint_interval=2"]),
        # resumed at step 2 into another folder, saving its last step 5
        _summary(["tokens.train_steps=5", f"checkpoints.checkpoints_path={b}",
                  "checkpoints.checkpoint_interval=100", "checkpoints.save_final_state=true",
                  f"checkpoints.resume_checkpoint_path={a}"]),
        # resumed at step 2 in the same folder, saving nothing: latest.txt still names step 2
        _summary(["tokens.train_steps=5", f"checkpoints.checkpoints_path={a}",
                  "checkpoints.checkpoint_interval=100", "checkpoints.save_final_state=false",
                  f"checkpoints.resume_checkpoint_path={a}"]),
    ]  # fmt: skip


def test_summary_after_a_resume_names_this_runs_steps_and_checkpoint(tmp_path):
    fresh, resumed, unsaved = run_ranks(1, _runs, tmp_path, timeout=200)[0]
    print("\n" + fresh + resumed + unsaved)
    assert ": 2 steps in " in fresh and "resumed" not in fresh
    assert f"checkpoint   {tmp_path / 'a' / '2'}\n" in fresh

    header = resumed.splitlines()[0]
    assert ": 3 steps in " in header and header.endswith("(resumed from step 2) ==")
    assert f"checkpoint   {tmp_path / 'b' / '5'}\n" in resumed

    assert ": 3 steps in " in unsaved and "(resumed from step 2)" in unsaved
    assert "checkpoint " not in unsaved  # this run saved none; step 2 is not its checkpoint
