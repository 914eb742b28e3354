"""benchmarks/tp_collectives.py --tiny, run as a user would (a subprocess): it exits 0 (so the
collective and the swap logged the same loss at every step), runs each way through its own
script, and reports both ways' tokens/s and their ratio per layout. Nothing asserts a speed: a
shared CPU is noisy."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tp_collectives_tiny_runs_both_ways_with_the_same_losses():
    cmd = [sys.executable, "benchmarks/tp_collectives.py", "--tiny"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads((ROOT / "benchmarks/results/local/tp_collectives_tiny.json").read_text())
    assert saved["same_losses"] is True
    assert set(saved["layouts"]) == {"tp2 REDUCE_SCATTER", "2x2x2 ALL_REDUCE"}
    for name, row in saved["layouts"].items():
        assert len(row["collective"]) == len(row["swap"]) == 1, name
        assert min(row["collective"] + row["swap"]) > 0, name
        assert abs(row["ratio"] - row["swap_median"] / row["collective_median"]) < 1e-9
        assert f"| {name} |" in proc.stdout
