"""Starcoder2 (Nanotron's Starcoder2Config): multi-query and grouped-query attention, sliding
windows with global layers, LayerNorm and GELU with biases, tied embeddings, and dropout whose
masks are the same at every layout: with dropout 0.1, dp2 x tp2 x pp2 (sequence parallel,
ZeRO-1, recomputed layers) and cp2 x tp2 x pp2 train like one process; Nanotron's checkpoint
names; a checkpoint saved at dp2 x tp2 x pp2 resumes in one process.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_starcoder2.py`."""

from __future__ import annotations

import pytest
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs
from test_starcoder2 import STAR

TOL = 1e-5


MC = "model.model_config"


GQA = [f"{MC}.grouped_query=true", f"{MC}.num_kv_heads=2", f"{MC}.sliding_window_size=6",
       f"{MC}.global_attn_layers=[1, 3]"]  # fmt: skip


NO_DROPOUT = [f"{MC}.{k}=0.0" for k in ("attn_pdrop", "embd_pdrop", "resid_pdrop")]


STEPS = "tokens.train_steps=3"


ONE = layout_overrides(1, 1, "ALL_REDUCE", 0, None) + [STEPS]


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    """One process: multi-query, grouped-query with windows, and multi-query without dropout."""
    runs = [ONE, ONE + GQA, ONE + NO_DROPOUT]
    return run_ranks(1, train_runs, runs, STAR, timeout=240)[0]


def test_dropout_changes_training(reference):
    mqa, _, plain = reference
    assert mqa["loss"][-1] < mqa["loss"][0]
    loss = abs(mqa["loss"][0] - plain["loss"][0]) / plain["loss"][0]
    norm = abs(mqa["grad_norm"][0] - plain["grad_norm"][0]) / plain["grad_norm"][0]
    print(f"\nstarcoder2 step 1, dropout 0.1 vs 0: loss {mqa['loss'][0]:.6f} vs "
          f"{plain['loss'][0]:.6f} ({loss:.2e}), grad norm {mqa['grad_norm'][0]:.4f} vs "
          f"{plain['grad_norm'][0]:.4f} ({norm:.2e})")  # fmt: skip
    assert loss > 1e-3 and norm > 0.05


def test_2x2x2_with_dropout_equals_one_process_and_resumes(reference, tmp_path):
    """dp2 x tp2 x pp2 (REDUCE_SCATTER, ZeRO-1, recomputed layers; multi-query, its key/value
    head whole on every tp rank) and cp2 x tp2 x pp2 (ALL_REDUCE; grouped-query, windows and
    global layers) with dropout 0.1 equal one process; the first saves step 2 in Nanotron's
    layout, from which one process resumes step 3 as the run that never stopped."""
    ck = tmp_path / "ck"
    pp = ["parallelism.pp=2", STEPS]
    runs = {
        "dp2 tp2 pp2 REDUCE_SCATTER zero1 recompute, multi-query": (
            layout_overrides(2, 2, "REDUCE_SCATTER", 1, None) + pp
            + ["parallelism.recompute_layer=true", f"checkpoints.checkpoints_path={ck}",
               "checkpoints.checkpoint_interval=2"]),
        "cp2 tp2 pp2 ALL_REDUCE, grouped-query windows": (
            layout_overrides(1, 2, "ALL_REDUCE", 0, None) + pp
            + ["parallelism.context_parallel_size=2", *GQA]),
    }  # fmt: skip
    results = run_ranks(8, train_runs, list(runs.values()), STAR, timeout=500)
    table = {n: max_rel_diff(run, ref) for n, run, ref in zip(runs, results[0], reference)}
    print("\nstarcoder2 parity:", table)
    for runs_of_rank in results:
        for name, run in zip(runs, runs_of_rank):
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table
    kv = ck / "2" / "model" / "model" / "decoder" / "0" / "pp_block" / "attn" / "qkv" / "kv"
    assert sorted(p.name for p in kv.iterdir()) == [
        "model_bias.safetensors",
        "model_weight.safetensors",
    ]
    resume = [f"checkpoints.resume_checkpoint_path={ck}", "checkpoints.checkpoint_interval=100",
              f"checkpoints.checkpoints_path={tmp_path / 'ck2'}"]  # fmt: skip
    (resumed,) = run_ranks(1, train_runs, [ONE + resume], STAR, timeout=120)[0]
    got, want = resumed["loss"][-1], reference[0]["loss"][-1]
    assert len(resumed["loss"]) == 1 and abs(got - want) / want <= TOL, (got, want)
