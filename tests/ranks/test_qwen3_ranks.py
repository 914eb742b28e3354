"""Qwen3 through the `mesh3d:` extension (Nanotron has no Qwen3): a Qwen2 model_config with
`mesh3d: {model_family: qwen3, head_dim: ...}` trains with q/k norms and a free head size at
every layout like one process, and converts to and from HF `Qwen3ForCausalLM` exactly.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_qwen3.py`."""

from __future__ import annotations

import pytest
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs
from test_qwen3 import QWEN3

TOL = 1e-5


STEPS = "tokens.train_steps=3"


@pytest.fixture(scope="module")
def reference() -> dict:
    base = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + [STEPS]
    (ref,) = run_ranks(1, train_runs, [base], QWEN3, timeout=120)[0]
    assert ref["loss"][-1] < ref["loss"][0] and "layers.0.self_attn.q_norm.weight" in ref["weights"]
    return ref


LAYOUTS = {
    4: [layout_overrides(2, 2, "REDUCE_SCATTER", 1, False), layout_overrides(1, 4, "ALL_REDUCE", 0, False)],
    2: [layout_overrides(1, 1, "ALL_REDUCE", 0, False) + ["parallelism.pp=2", "model.model_config.num_hidden_layers=2"]],
}  # fmt: skip


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_qwen3_layouts_match_one_process(world, reference):
    runs = [r + [STEPS] for r in LAYOUTS[world]]
    results = run_ranks(world, train_runs, runs, QWEN3, timeout=300)
    diffs = [max_rel_diff(run, reference) for run in results[0]]
    print("qwen3 parity:", diffs)
    for runs_of_rank in results:
        assert all(not run["replica_mismatches"] for run in runs_of_rank)
    assert all(d <= TOL for d in diffs), diffs
