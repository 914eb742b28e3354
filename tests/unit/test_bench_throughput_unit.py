"""benchmarks/throughput.py and benchmarks/gpu.sh, run as a user would (subprocesses).

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/launch/test_bench_throughput.py`."""

import importlib
import sys

import pytest
from test_bench_throughput import ROOT


def test_compiled_ways_ratios_and_table():
    if str(ROOT / "benchmarks") not in sys.path:  # as when the script runs
        sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("throughput")
    seconds = dict(mesh3d=1.0, plain=1.0, transformers=1.2, mesh3d_compiled=1.0,
                   transformers_compiled=0.8)  # fmt: skip
    impls = {  # round 1: compiling (30 s), left out as a warm-up round
        name: dict(step_seconds=[30.0] + [s] * 4, losses=[5.0, 4.0, 3.0, 2.0, 1.0])
        for name, s in seconds.items()
    }
    ratios = bench.summarize(impls, tokens=1000, warmup=1)
    assert ratios["mesh3d_compiled_over_transformers"] == pytest.approx(1.2)
    assert ratios["mesh3d_compiled_over_transformers_compiled"] == pytest.approx(0.8)
    assert ratios["mesh3d_compiled_over_transformers_paired_ci95"] == pytest.approx((1.2, 1.2))
    assert ratios["mesh3d_compiled_over_transformers_target"] == 1.15
    text = bench.table(dict(impls=impls, ratios=ratios))
    assert "| transformers_compiled | 1250 | 5.00000 | 1.00000 |" in text, text
    assert "| mesh3d_compiled / transformers | 1.200 | 1.200 [1.200, 1.200] | ≥ 1.15 |" in text
    assert "| mesh3d_compiled / transformers_compiled | 0.800 | 0.800 [0.800, 0.800] |" in text
