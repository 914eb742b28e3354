"""A data stage with its own, longer `sequence_length` (long-context annealing): steps 1-3 train
on 16 tokens per sample, steps 4-6 on 32.

One 4-rank launch trains the 6 steps at dp2 x tp2 (sequence parallel), dp2 x cp2, dp2 x pp2
and dp2 x pp2 under zbv_zero_bubble (2 stages per rank, split backward) — the pipeline switches
to stages declared at 32 tokens — saving at steps 3 and 6, and resumes the tp and pp runs from
step 3 (across the stage boundary). One
1-rank launch trains the same config on one process. Every layout's losses, gradient norms and
weights equal the one-process run's (fp32, within 1e-5), the resumed steps equal the
uninterrupted ones bitwise, the batches have the stage's length, and the checkpoint metadata
records each stage's length.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dist import run_ranks
from parity import TINY, full_weights, layout_overrides, max_rel_diff

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.train.hooks import KeepModel
from mesh3d.train.loop import train

STAGES = (
    "data_stages=[{name: short, start_training_step: 1, data: {seed: 3}}, "
    "{name: long, start_training_step: 4, sequence_length: 32, data: {seed: 4}}]"
)
BASE = [STAGES, "model.model_config.max_position_embeddings=32", "tokens.train_steps=6"]
LAYERS4 = ["model.model_config.num_hidden_layers=4"]  # 4 pipeline stages need 4 layers


class Shapes:
    """Each step's microbatch input shape on this rank (None: a pipeline rank reading no data)."""

    def __init__(self):
        self.shapes: list[tuple] = []

    def on_step(self, run, step: int, out, metrics: dict) -> None:
        self.shapes.append(tuple(out.batches[0][0].shape) if out.batches else None)


def _runs(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    out = []
    for overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
        shapes = Shapes()
        res = train(cfg, hooks=[KeepModel(), shapes])
        weights = full_weights(res.model, res.mesh)
        out.append({
            "loss": [m["lm_loss"] for m in res.metrics],
            "grad_norm": [m["grad_norm"] for m in res.metrics],
            "tokens": [m["consumed_tokens"] for m in res.metrics],
            "weights": weights if rank == 0 else None,
            "shapes": shapes.shapes,
        })  # fmt: skip
    return out


def _ck(root, resume=None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=3"]
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    t = tmp_path_factory.mktemp("stage_lengths")
    tp = layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + BASE
    cp = layout_overrides(2, 1, "ALL_REDUCE", 1, False) + BASE
    cp += ["parallelism.context_parallel_size=2"]
    pp = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + BASE + ["parallelism.pp=2"]
    zb = layout_overrides(2, 1, "ALL_REDUCE", 0, False, microbatches=4) + BASE
    zb += [*LAYERS4, "parallelism.pp=2", "mesh3d.pp_schedule=zbv_zero_bubble",
           "mesh3d.pp_virtual_stages=2"]  # fmt: skip
    four = run_ranks(
        4, _runs, [tp + _ck(t / "tp"), cp + _ck(t / "cp"), tp + _ck(t / "from3", t / "tp" / "3"),
                   pp + _ck(t / "pp"), pp + _ck(t / "pp3", t / "pp" / "3"), zb],
        timeout=300,
    )  # fmt: skip
    ref = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + BASE
    one = run_ranks(1, _runs, [ref, ref + LAYERS4], timeout=300)[0]
    return {"four": four, "one": one[0], "one4": one[1], "root": t}


def test_longer_stage_trains_at_its_length(runs):
    one = runs["one"]
    assert one["shapes"] == [(2, 16)] * 3 + [(2, 32)] * 3  # 4 microbatches of 2 per step
    assert one["tokens"] == [8 * 16 * k for k in (1, 2, 3)] + [8 * (48 + 32 * k) for k in (1, 2, 3)]
    assert all(torch.isfinite(torch.tensor(one["loss"])))
    tp_rank0 = runs["four"][0][0]
    assert tp_rank0["shapes"] == [(2, 16)] * 3 + [(2, 32)] * 3  # dp rank 0: 2 microbatches of 2


@pytest.mark.parametrize(
    "which", [0, 1, 3, 5], ids=["dp2-tp2-sp", "dp2-cp2", "dp2-pp2", "dp2-pp2-zbv"]
)
def test_every_layout_equals_one_process(runs, which):
    got = runs["four"][0][which]
    assert max_rel_diff(got, runs["one4" if which == 5 else "one"]) <= 1e-5


def test_resume_across_the_stage_boundary_is_exact(runs):
    for rank, (straight, _, from3, pp, pp3, _) in enumerate(runs["four"]):
        for a, b in ((straight, from3), (pp, pp3)):
            assert b["loss"] == a["loss"][3:], rank
            assert b["grad_norm"] == a["grad_norm"][3:], rank
            assert b["shapes"] == a["shapes"][3:], rank
            assert b["tokens"] == a["tokens"][3:], rank
    for a, b in ((0, 2), (3, 4)):
        straight, resumed = runs["four"][0][a]["weights"], runs["four"][0][b]["weights"]
        assert all(torch.equal(resumed[k], w) for k, w in straight.items())


def test_checkpoint_records_each_stage_length(runs):
    meta = json.loads((runs["root"] / "tp" / "6" / "checkpoint_metadata.json").read_text())
    stages = meta["metas"]["data_stages"]
    assert [(s["name"], s["sequence_length"]) for s in stages] == [("short", 16), ("long", 32)]
    assert [s["consumed_train_samples"] for s in stages] == [24, 24]
