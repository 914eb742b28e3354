"""benchmarks/model_constants.py, run as a user would: the device's rates against the step-time
model's constants, here on this CPU against the measured `cpu` profile (on a GPU it runs in
benchmarks/gpu.sh)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from launch import quiet_env

ROOT = Path(__file__).resolve().parents[2]


def test_rates_and_one_layer_against_the_model(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_constants.py"), "--quick",
         "--repeats", "2", "--no-compile"],
        cwd=tmp_path, env=quiet_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "vs profile cpu, float32" in run.stdout and "model speed / measured" in run.stdout
    written = run.stdout.strip().splitlines()[-1].removeprefix("wrote ")
    rows = json.loads(Path(written).read_text())["rows"]
    assert sorted(rows) == ["attention fraction", "layer s, eager", "matmul fraction",
                            "memory GB/s", "ring block fraction"]  # fmt: skip
    for key, r in rows.items():
        assert r["measured"] > 0 and r["model"] > 0 and math.isfinite(r["measured"]), key
        expect = r["measured"] / r["model"] if r["unit"] == "s" else r["model"] / r["measured"]
        assert r["model_speed_over_measured"] == pytest.approx(expect), key
    # the model prices one eager layer on this CPU within a factor of 3 (measured: 0.81-1.18)
    assert 1 / 3 < rows["layer s, eager"]["model_speed_over_measured"] < 3
