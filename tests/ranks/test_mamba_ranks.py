"""Mamba-1 (Nanotron's examples/mamba) at dp2 x tp2 x pp2 trains like one process: in_proj and
dt_proj column-parallel, x_proj and out_proj row-parallel, the scan on each rank's channels,
under ALL_REDUCE and under REDUCE_SCATTER with ZeRO-1 and recomputed layers.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_mamba.py`."""

from __future__ import annotations

import pytest
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs
from test_mamba import MAMBA, VOCAB

TOL = 1e-5
STEPS = "tokens.train_steps=3"
ONE = layout_overrides(1, 1, "ALL_REDUCE", 0, None) + [STEPS]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run_ranks(1, train_runs, [ONE], MAMBA, timeout=240)[0]


def test_one_process_trains(reference):
    (one,) = reference
    assert one["loss"][-1] < one["loss"][0], one["loss"]


def test_2x2x2_equals_one_process_and_resumes(reference, tmp_path):
    """Both tp modes at dp2 x tp2 x pp2 equal one process; the second saves step 2 in Nanotron's
    layout (the channel tensors split on dim 0 over tp), from which one process resumes step 3
    as the run that never stopped."""
    ck = tmp_path / "ck"
    pp = ["parallelism.pp=2", STEPS]
    runs = {
        "dp2 tp2 pp2 ALL_REDUCE": layout_overrides(2, 2, "ALL_REDUCE", 0, None) + pp,
        "dp2 tp2 pp2 REDUCE_SCATTER zero1 recompute": (
            layout_overrides(2, 2, "REDUCE_SCATTER", 1, None) + pp
            + ["parallelism.recompute_layer=true", f"checkpoints.checkpoints_path={ck}",
               "checkpoints.checkpoint_interval=2"]),
    }  # fmt: skip
    results = run_ranks(8, train_runs, list(runs.values()), MAMBA, timeout=500)
    table = {n: max_rel_diff(run, reference[0], VOCAB) for n, run in zip(runs, results[0])}
    print("\nmamba parity (max relative difference, losses, grad norms, every weight):", table)
    for runs_of_rank in results:
        for name, run in zip(runs, runs_of_rank):
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table
    mixer = ck / "2" / "model" / "model" / "decoder" / "2" / "pp_block" / "mixer"
    for part in ("conv1d", "dt_proj", "in_proj"):
        assert sorted(p.name for p in (mixer / part).glob("model_weight_*")) == [
            f"model_weight_pp-rank-1-of-2_tp-rank-{t}-of-2.safetensors" for t in (0, 1)
        ], part
    resume = [f"checkpoints.resume_checkpoint_path={ck}", "checkpoints.checkpoint_interval=100",
              f"checkpoints.checkpoints_path={tmp_path / 'ck2'}"]  # fmt: skip
    (resumed,) = run_ranks(1, train_runs, [ONE + resume], MAMBA, timeout=120)[0]
    got, want = resumed["loss"][-1], reference[0]["loss"][-1]
    assert len(resumed["loss"]) == 1 and abs(got - want) / want <= TOL, (got, want)
