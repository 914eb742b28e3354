"""Replica ranks stay quiet below WARNING unless asked for `debug` (mesh3d/log.py).

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_log_levels.py`."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


CONFIG = ROOT / "recipes" / "configs" / "cpu_tiny.yaml"


def test_dp2_prints_the_start_lines_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(ROOT / "recipes" / "train.py"), "--config-file", str(CONFIG), "parallelism.dp=2",
           "tokens.train_steps=6", "logging.log_level_replica=info"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("Total number of parameters") == 1, r.stdout
    assert r.stdout.count("[Start training]") == 1, r.stdout
    assert r.stdout.count("iteration: ") == 6  # the owner logs at log_level
