"""recipes/config_tiny_llama.py: the starter config it writes, and the parameter count it prints.

- The config is valid at its own 8 ranks, has Nanotron's checkpoints section and learnable dummy
  data (`mesh3d.dummy_data`); `--dummy-data random` writes no `mesh3d:` section (Nanotron's
  strict parser refuses one).
- The printed count is the one training logs ("Total number of parameters": padded vocabulary,
  tied embedding once), checked by arithmetic and by a one-process run of the config, whose
  loss falls on the learnable data.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from mesh3d.checks import validate
from mesh3d.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "config_tiny_llama.py"
ONE_RANK = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"]


def _write(tmp_path: Path, *args: str) -> tuple[Path, str]:
    out = tmp_path / "tiny.yaml"
    cmd = [sys.executable, str(SCRIPT), "--output", str(out), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r.stdout


def _printed_count(stdout: str) -> int:
    return int(
        re.search(r"Model has \S+ parameters \(([\d,]+)\)", stdout).group(1).replace(",", "")
    )


def test_config_is_valid_learnable_and_checkpointed(tmp_path):
    path, stdout = _write(tmp_path)
    cfg = load_config(path)
    validate(cfg, world_size=8)
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (2, 2, 2)
    assert cfg.mesh3d.dummy_data == "learnable"
    assert cfg.checkpoints.checkpoints_path == "checkpoints"
    assert cfg.checkpoints.checkpoint_interval == 10
    h, f, v, layers = 16, 64, 256, 2  # tied: the embedding once; 4 q + 2 x 4 kv heads of 4
    per_layer = 2 * h + (h + 2 * h) * h + h * h + 2 * f * h + f * h
    assert _printed_count(stdout) == v * h + layers * per_layer + h == 12_368


def test_random_dummy_data_writes_no_mesh3d_section(tmp_path):
    path, _ = _write(tmp_path, "--dummy-data", "random")
    assert "mesh3d" not in yaml.safe_load(path.read_text())
    assert load_config(path).mesh3d.dummy_data == "random"


def test_training_logs_the_printed_count_and_learns(tmp_path):
    path, stdout = _write(tmp_path)
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "--config-file", str(path),
           *ONE_RANK, "checkpoints.checkpoint_interval=100"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logged = int(re.search(r"Total number of parameters: (\d+)", r.stdout).group(1))
    assert logged == _printed_count(stdout)
    losses = [float(x) for x in re.findall(r"lm_loss: ([\d.]+)", r.stdout)]
    assert len(losses) == 15 and losses[-1] < losses[0] - 0.02, losses
