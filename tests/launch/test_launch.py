"""`mesh3d train` (mesh3d/launch.py): a config mistake stops before any process starts; a
multi-rank config starts its own ranks through torch's elastic launcher, ends with a summary,
and a SIGTERM to it saves and exits 75, like torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "configs" / "cpu_tiny.yaml")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def mesh3d_train(*args: str) -> list[str]:
    return [sys.executable, "-m", "mesh3d.launch", *args]


def test_config_mistake_is_one_line_before_any_rank_starts(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(mesh3d_train(TINY, "parallelism.dp=2", "parallelism.tp=3"), cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: 4 problems in the config:") and "Traceback" not in r.stderr
    assert r.stderr.count("error:") == 1 and time.monotonic() - t0 < 30


def test_two_ranks_started_by_mesh3d_train_summary_then_sigterm_saves(tmp_path):
    ck = tmp_path / "ck"
    r = subprocess.run(mesh3d_train(TINY, "parallelism.dp=2", "tokens.train_steps=6"), cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = re.search(r"== run (\S+): 6 steps in", r.stdout).group(1)
    metrics = tmp_path / "runs" / run / "metrics.jsonl"
    assert f"metrics      runs/{run}/metrics.jsonl" in r.stdout and metrics.is_file()
    assert re.search(r"train loss   [\d.]+ \(step 1\) -> [\d.]+", r.stdout)
    # the same launch, preempted: every rank saves the step it is in, the launcher exits 75
    args = [TINY, "parallelism.dp=2", "tokens.train_steps=400", f"checkpoints.checkpoints_path={ck}",
            "checkpoints.checkpoint_interval=1000"]  # fmt: skip
    proc = subprocess.Popen(mesh3d_train(*args), cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    seen = ""
    while "iteration: 3 / 400" not in seen:
        line = proc.stdout.readline()
        assert line, seen[-2000:]
        seen += line
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, (seen + out)[-3000:]
    step = int(re.search(r"preempted: SIGTERM received: stopped after step (\d+)", out).group(1))
    assert (ck / "latest.txt").read_text() == str(step)
