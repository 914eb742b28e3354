"""LlaMoE (Nanotron's examples/moe) at dp2 x tp2 x pp2 trains like one process: attention split
over tp as Llama's, the experts replicated over tp (each rank runs its tokens) and, with
expert_parallel_size 2, split over the dp ranks; a checkpoint saved there is in the example's
layout (w1, w2 [E·F, h] split on dim 0 over tp, no ep rank in the file names; the router one
file) and one process reads it back and resumes as the run that never stopped.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_llamoe.py`."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs
from test_llamoe import LLAMOE, VOCAB

from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.config import config_from_dict
from mesh3d.models.registry import model_shape, spec_of

TOL = 1e-5
STEPS = "tokens.train_steps=3"
ONE = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + [STEPS]
EP2 = "parallelism.expert_parallel_size=2"


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run_ranks(1, train_runs, [ONE], LLAMOE, timeout=240)[0]


def test_one_process_trains(reference):
    (one,) = reference
    assert one["loss"][-1] < one["loss"][0], one["loss"]
    assert len(one["moe"]) == 3 and all(load >= 1 for _, load in one["moe"])


def test_2x2x2_equals_one_process_and_its_checkpoint_reads_back(reference, tmp_path):
    """Both tp modes at dp2 x tp2 x pp2 (the first with the experts split over ep 2) equal one
    process; the first saves step 2, whose expert files are the example's; one process loads
    every tensor of it into the model and resumes step 3 as the run that never stopped."""
    ck = tmp_path / "ck"
    pp = ["parallelism.pp=2", STEPS]
    runs = {
        "dp2 ep2 tp2 pp2 ALL_REDUCE": (
            layout_overrides(2, 2, "ALL_REDUCE", 0, False) + pp
            + [EP2, f"checkpoints.checkpoints_path={ck}", "checkpoints.checkpoint_interval=2"]),
        "dp2 tp2 pp2 REDUCE_SCATTER zero1 recompute": (
            layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + pp
            + ["parallelism.recompute_layer=true"]),
    }  # fmt: skip
    results = run_ranks(8, train_runs, list(runs.values()), LLAMOE, timeout=500)
    table = {n: max_rel_diff(run, reference[0], VOCAB) for n, run in zip(runs, results[0])}
    print("\nllamoe parity (max relative difference, losses, grad norms, every weight):", table)
    for runs_of_rank in results:
        for name, run in zip(runs, runs_of_rank):
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table

    model = ck / "2" / "model"
    for w in ("w1", "w2"):
        files = sorted(
            model.glob(f"model/decoder/*/pp_block/block_sparse_moe/experts/mlp/{w}/module/*")
        )
        pattern = r"model/decoder/(\d)/pp_block/.*/model_weight_pp-rank-(\d)-of-2_tp-rank-(\d)-of-2\.safetensors"
        found = [re.fullmatch(pattern, str(f.relative_to(model))) for f in files]
        assert all(found) and sorted((m[1], m[3]) for m in found) == [
            (i, t) for i in "01" for t in "01"
        ], files  # fmt: skip
    routers = sorted(model.glob("model/decoder/*/pp_block/block_sparse_moe/gate/layer/*"))
    assert [f.name for f in routers] == ["model_weight.safetensors"] * 2
    cfg = config_from_dict(copy.deepcopy(LLAMOE))
    full = read_nanotron_weights(model, model_shape(cfg))
    one = spec_of(cfg.model.model_config).build(cfg.model.model_config, vocab_size=VOCAB)
    assert set(full) == set(dict(one.named_parameters()))
    one.load_state_dict(full, strict=True)
    assert full["layers.1.mlp.experts.w2"].shape == (4 * 24, 32)

    resume = [f"checkpoints.resume_checkpoint_path={ck}", "checkpoints.checkpoint_interval=100",
              f"checkpoints.checkpoints_path={tmp_path / 'ck2'}"]  # fmt: skip
    (resumed,) = run_ranks(1, train_runs, [ONE + resume], LLAMOE, timeout=120)[0]
    got, want = resumed["loss"][-1], reference[0]["loss"][-1]
    assert len(resumed["loss"]) == 1 and abs(got - want) / want <= TOL, (got, want)
    assert torch.isfinite(torch.tensor(resumed["grad_norm"])).all()
