"""The config package: Nanotron's real configs parse and round-trip, every bad config gets its message.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_config.py`."""

import os
import subprocess
import sys

import pytest
import yaml
from test_config import BAD, REPO, base


def _cli(tmp_path, d, *args, env=None):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(d))
    cmd = [sys.executable, "-m", "mesh3d.checks", str(cfg), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60, env=env)


CLI_BAD = ["unknown-key", "override-no-equals", "world-size", "qwen2-moe", "mamba-bias",
           "starcoder2-heads-tp", "starcoder2-mq-gq", "starcoder2-global-layers", "s3-no-s5cmd",
           "eval-job-no-sbatch"]  # fmt: skip


@pytest.mark.parametrize("case", CLI_BAD)
def test_cli_exit_2_without_traceback(case, tmp_path):
    _, overrides, mutate, world, fragment = next(b for b in BAD if b[0] == case)
    d = base()
    if mutate:
        mutate(d)
    # s5cmd named by a path that is not here falls back to the one on PATH: none on PATH here
    env = None
    if "needs s5cmd" in fragment or "with sbatch" in fragment:  # a named s5cmd falls back to PATH
        env = {k: v for k, v in os.environ.items() if k != "MESH3D_SBATCH"}
        env["PATH"] = str(tmp_path)
    r = _cli(tmp_path, d, *overrides, *(["--world-size", str(world)] if world else []), env=env)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and fragment in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # one line
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_cli_prints_resolved_yaml(tmp_path):
    r = _cli(tmp_path, base(), "--world-size", "2", "parallelism.dp=2")
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    assert out["parallelism"]["dp"] == 2
    assert out["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] == 18
    code = "import sys, mesh3d.config; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
