"""`mesh3d plot`: two synthetic metrics files make one PNG (signature, size, default path), the
validation curve appears only for a file with `val_loss`, run labels, and the errors a new user
meets: a missing, empty or non-JSON file (named with its line), no matplotlib, and the CLI's exit
code 2 without a traceback.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_plot.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mesh3d.cli import main as mesh3d_main

REPO = Path(__file__).resolve().parents[2]


def test_cli_exits_2_without_traceback(tmp_path, capsys):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text("not json\n")
    cmd = [sys.executable, "-m", "mesh3d.plot", str(bad)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: metrics file {bad} line 1 is not JSON")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and r.stdout == ""

    with pytest.raises(SystemExit) as exit_info:  # the same through `mesh3d plot`
        mesh3d_main(["plot", str(tmp_path / "nope.jsonl")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: metrics file {tmp_path / 'nope.jsonl'}")
