"""Benchmarks write to a folder git ignores unless asked to publish (benchmarks/_results.py).

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_bench_results.py`."""

import subprocess

from test_bench_results import BENCH, ROOT, _load


def test_default_folder_is_ignored_and_publish_is_tracked():
    results = _load("_results")
    assert results.LOCAL == BENCH / "results" / "local"
    assert results.PUBLISHED == BENCH / "results"
    probe = "benchmarks/results/local/x.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    assert ignored.returncode == 0, "benchmarks/results/local/ must be in .gitignore"
    tracked = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/x.json"], cwd=ROOT)
    assert tracked.returncode == 1
