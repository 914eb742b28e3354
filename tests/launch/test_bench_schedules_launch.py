"""benchmarks/schedules: the simulator against the closed forms, and a `--tiny` run's outputs.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_bench_schedules.py`."""

import json
import subprocess
import sys

import pytest
from test_bench_schedules import CLOSED_FORMS, ROOT, SCRIPT, ZERO_BUBBLE

from mesh3d.parallel.pipeline import SCHEDULES


def test_tiny_run_writes_json_table_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.startswith("command: python ")

    result = json.loads((tmp_path / "schedules.json").read_text())
    for key in ("command", "torch", "cores", "date", "model", "probe", "measured", "simulated",
                "skipped", "runtime_s"):  # fmt: skip
        assert key in result, key
    assert {r["schedule"] for r in result["measured"]} == set(SCHEDULES)
    assert {r["schedule"] for r in result["simulated"]} == set(SCHEDULES)
    for r in result["measured"] + result["simulated"]:
        for key in ("bubble", "bubble_sim", "bubble_unit"):
            assert key not in r or 0 <= r[key] < 1, (r["schedule"], key, r.get(key))
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["timeline_ms"]) == r["pp"]
        for events in r["timeline_ms"].values():
            assert events and all(e[0] in "FBIW" and 0 <= e[3] <= e[4] for e in events)
    for r in result["measured"]:
        assert r["order_matches_table"], r["schedule"]
        assert all(b > 0 for b in r["saved_peak_bytes"])
    for r in result["simulated"]:
        if r["schedule"] in CLOSED_FORMS + ZERO_BUBBLE:  # unit costs: F = I = W
            assert r["bubble_unit"] == pytest.approx(r["bubble_analytic"], abs=1e-12)
    assert all(s["reason"] for s in result["skipped"])

    md = (tmp_path / "schedules.md").read_text()
    sections = md.split("### ")
    measured = next(s for s in sections if s.startswith("measured"))
    simulated = next(s for s in sections if s.startswith("simulated"))
    for name in SCHEDULES:
        assert f"| {name} |" in measured and f"| {name} |" in simulated, name
    rows = [ln for ln in simulated.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 1 + len(result["simulated"])  # header + one row per simulated run

    png = (tmp_path / "schedules.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
