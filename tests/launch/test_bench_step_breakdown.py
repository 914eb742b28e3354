"""benchmarks/step_breakdown.py --tiny, run as a user would (a subprocess): it exits 0, prints a
row per phase, and what it measured is consistent: the phases' CPU seconds fit inside the step's,
a one-process run spends nothing on dp, tp or pp communication, and a 2x2x2 run does. Nothing
asserts a speed: a shared CPU is noisy."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_breakdown_tiny_times_every_phase(tmp_path):
    cmd = [sys.executable, "benchmarks/step_breakdown.py", "--tiny"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads((ROOT / "benchmarks/results/local/step_breakdown_tiny.json").read_text())
    one, three = saved["layouts"]["1x1x1 1 thread"], saved["layouts"]["2x2x2"]
    assert (one["ranks"], three["ranks"]) == (1, 8)
    for phase in ("read batch", "forward+backward", "norm + clip", "optimizer", "stop check"):
        assert f"| {phase} |" in proc.stdout, phase
    for layout in (one, three):
        assert all(v >= 0 for v in layout["cpu"].values())
        assert sum(layout["cpu"].values()) <= layout["step_cpu"] * 1.02 + 1e-3
        assert layout["cpu"]["forward+backward"] > 0.5 * sum(layout["cpu"].values())
    for phase in ("dp grad sum", "tied-embedding sync", "partial-grad reduce"):
        assert one["cpu"][phase] < 1e-3 < three["cpu"][phase], phase  # a no-op call at most
