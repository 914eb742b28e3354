"""`mesh3d.plan`: groups, stages and bubbles by hand; the CLI; memory numbers against real runs.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_plan.py`."""

import subprocess
import sys

from test_plan import CPU_TINY, ROOT


def test_cli_report_and_user_error():
    good = [sys.executable, "-m", "mesh3d.plan", CPU_TINY, "parallelism.tp=2", "--world-size", "2"]
    bad = good[:-1] + ["3"]  # dp * tp * pp = 2
    procs = [  # both at once: most of each run is importing torch
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for c in (good, bad)
    ]
    (out, err), (bad_out, bad_err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err
    for heading in ("1. Rank groups", "2. Pipeline stages", "3. Memory per rank", "5. Pipeline"):
        assert heading in out
    assert "tp: [0, 1]" in out
    assert procs[1].returncode == 2
    assert (
        bad_err.startswith("error: ")
        and "--world-size 3, but parallelism.dp (1) x tp (2)" in bad_err
    )
    assert "give --world-size 2" in bad_err and "--nproc_per_node" not in bad_err
    assert "Traceback" not in bad_err + bad_out
