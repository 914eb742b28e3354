"""`recipes/sft_arithmetic.py`, the SFT starter, run as a user runs it (a real process): the
summary gives the exact-match accuracy before and after, and training raises it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sft_starter_reports_exact_match_before_and_after(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    r = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "sft_arithmetic.py"), "--output",
         str(tmp_path / "run"), "--steps", "60", "--held-out", "30"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"exact match\s+(\d+)/30 \(\d+%\) before -> (\d+)/30 \(\d+%\) after", r.stdout)
    assert m, r.stdout
    before, after = int(m[1]), int(m[2])
    loss = re.search(r"train loss\s+([\d.]+) -> ([\d.]+)", r.stdout)
    assert float(loss[2]) < float(loss[1]) / 2, r.stdout
    assert after > before, r.stdout
