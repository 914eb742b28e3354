"""`mesh3d plan --search --write`: the best layout's config trains.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_plan_search.py`."""

import os
import subprocess
import sys

from test_plan import CPU_TINY, ROOT


def test_written_best_layout_trains_one_step(tmp_path):
    best = tmp_path / "best.yaml"
    search = [sys.executable, "-m", "mesh3d.plan", "--search", CPU_TINY, "--world-size", "4",
              "--write", str(best)]  # fmt: skip
    r = subprocess.run(search, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wrote {best}" in r.stdout
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    train = [
        sys.executable,
        "-m",
        "mesh3d.launch",
        str(best),
        "tokens.train_steps=1",
        "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
    ]
    r = subprocess.run(train, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 steps in" in r.stdout or "1 step in" in r.stdout, r.stdout[-2000:]
