"""`mesh3d plan --dry-run`: every distinct rank of 512-rank layouts built as training builds them.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_plan_dry_run.py`."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_dry_run_report_and_construction_error():
    tiny = str(ROOT / "recipes/configs/cpu_tiny.yaml")
    good = [sys.executable, "-m", "mesh3d.plan", tiny, "--dry-run", "--world-size", "8",
            "parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"]  # fmt: skip
    bad = [sys.executable, "-m", "mesh3d.cli", "plan", tiny, "--dry-run", "mesh3d.attention=flash"]
    try:
        import flash_attn  # noqa: F401

        bad = None  # installed: the flash config builds
    except ImportError:
        pass
    procs = [  # both at once: most of each run is importing torch
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for c in (good, bad)
        if c
    ]
    (out, err), *rest = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err
    assert "7. Dry run: 2 representative rank(s) of 8" in out and "built in" in out
    assert out.count(" ok ") == 2 and "DIFFERS" not in out
    if rest:
        (bad_out, bad_err), code = rest[0], procs[1].returncode
        assert code == 2 and bad_err.startswith("error: dry run: rank 0 (pp 0, dp 0, cp 0, tp 0)")
        assert "failed building the model (its family's spec.build): ImportError" in bad_err
        assert "Traceback" not in bad_err + bad_out and len(bad_err.splitlines()) == 1
