"""Where a benchmark writes its results.

A plain run writes under `benchmarks/results/local/`, which git ignores, so trying a benchmark
never changes a tracked file. `--publish` writes to `benchmarks/results/` itself, the numbers the
READMEs quote; commit those on purpose. A script's own `--out` (where it has one) still wins.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

PUBLISHED = Path(__file__).resolve().parent / "results"
LOCAL = PUBLISHED / "local"


def add_publish_flag(ap: argparse.ArgumentParser) -> None:
    """Add `--publish` to a benchmark's command line."""
    ap.add_argument(
        "--publish",
        action="store_true",
        help="write to the tracked benchmarks/results/ (default: benchmarks/results/local/, "
        "which git ignores)",
    )


def results_dir(publish: bool) -> Path:
    """The folder for this run's result files, created: the tracked one only when publishing."""
    folder = PUBLISHED if publish else LOCAL
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def print_header() -> dict:
    """Print the exact command, torch's version, the core count and the date (what every
    benchmark prints first); returns them for the result file."""
    import torch

    print("command:", "python", *map(shlex.quote, sys.argv))
    head = {"date": str(datetime.date.today()), "torch": torch.__version__, "cores": os.cpu_count()}
    print(f"torch {head['torch']} | cores {head['cores']} | {head['date']}")
    return head
