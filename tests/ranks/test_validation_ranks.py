"""Validation loss (`tokens.val_check_interval`, `tokens.limit_val_batches`).

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_validation.py`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides
from test_qwen2 import QWEN
from test_validation import _cfg, _val

TOL = 1e-5


def _pp(schedule: str, virtual: int) -> list[str]:
    return [
        "parallelism.pp=2",
        f"mesh3d.pp_schedule={schedule}",
        f"mesh3d.pp_virtual_stages={virtual}",
    ]


LAYERS = ["model.model_config.num_hidden_layers=4", "logging.iteration_step_info_interval=3"]


RUNS = {  # name -> (base, 1-rank overrides, 8-rank overrides, validation)
    "llama 1f1b": (TINY, layout_overrides(1, 1, "ALL_REDUCE", 0, False),
                   layout_overrides(2, 2, "ALL_REDUCE", 0, False) + _pp("1f1b", 1), _val(2, 2, 4)),
    "zbv zero1": (TINY, layout_overrides(1, 1, "ALL_REDUCE", 0, True),
                  layout_overrides(2, 2, "REDUCE_SCATTER", 1, True, microbatches=4)
                  + _pp("zbv_zero_bubble", 2), _val(2, 1, 2)),
    "qwen2 documents": (QWEN, layout_overrides(1, 1, "ALL_REDUCE", 0, True),
                        layout_overrides(2, 2, "REDUCE_SCATTER", 1, True) + _pp("1f1b", 1),
                        _val(1, 2, 2)),
    "qwen2 documents cp2": (QWEN, layout_overrides(1, 1, "ALL_REDUCE", 0, True),
                            layout_overrides(1, 2, "REDUCE_SCATTER", 1, True) + _pp("1f1b", 1)
                            + ["parallelism.context_parallel_size=2"], _val(1, 2, 2)),
}  # fmt: skip


def _rank(rank: int, world: int, root: str) -> dict:
    from torch.distributed.tensor import DTensor

    from mesh3d.train.evaluate import evaluate
    from mesh3d.train.hooks import KeepModel
    from mesh3d.train.loop import train
    from mesh3d.train.run import Run

    out = {}
    for name, (base, one, eight, val) in RUNS.items():
        cfg = _cfg((one if world == 1 else eight) + LAYERS + val, base)
        res = train(cfg, metrics_file=f"{root}/{world}-{name}.jsonl", hooks=[KeepModel()])
        stages = list(res.model) if isinstance(res.model, torch.nn.ModuleList) else [res.model]
        at_rest = [
            n for s in stages for n, p in s.named_parameters()
            if world > 1 and cfg.optimizer.zero_stage
            and not (isinstance(p, DTensor)
                     and any("dp" in n.split("_") for n in p.device_mesh.mesh_dim_names))
        ]  # fmt: skip
        out[name] = {"metrics": res.metrics, "not_at_rest": at_rest}
    run = Run.prepare(_cfg((RUNS["llama 1f1b"][1] if world == 1 else RUNS["llama 1f1b"][2]) + LAYERS
                      + _val(2, 2, 4)))  # fmt: skip
    twice = [evaluate(run.parts, run.data.validation, run.layout, run.mesh, run.device)
             for _ in range(2)]  # fmt: skip
    out["initial"] = twice
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("metrics")
    one = run_ranks(1, _rank, str(root), timeout=300)[0]
    eight = run_ranks(8, _rank, str(root), timeout=600)
    return {"one": one, "eight": eight, "root": root}


def _val_losses(metrics: list[dict]) -> dict[int, float]:
    return {m["iteration"]: m["val_loss"] for m in metrics if "val_loss" in m}


def test_val_loss_is_the_same_at_1x1x1_and_2x2x2(runs):
    table = {}
    for name in RUNS:
        ref = _val_losses(runs["one"][name]["metrics"])
        got = _val_losses(runs["eight"][0][name]["metrics"])
        assert ref.keys() == got.keys()
        table[name] = {step: abs(got[step] - ref[step]) / ref[step] for step in ref}
        for rank in runs["eight"]:  # every rank reports the same value
            assert _val_losses(rank[name]["metrics"]) == got, name
    (a, b), (c, d) = runs["one"]["initial"], runs["eight"][0]["initial"]
    table["initial weights"] = {0: abs(c["val_loss"] - a["val_loss"]) / a["val_loss"]}
    print(f"\nval_loss, relative difference 2x2x2 vs 1x1x1 by step: {table}")
    assert all(v <= TOL for t in table.values() for v in t.values()), table
    assert a == b and c == d  # evaluating again without an update: the same value
    assert abs(a["val_loss"] - math.log(250)) < 0.5  # initial weights: about uniform


def test_val_loss_appears_exactly_at_the_interval_steps(runs):
    for name, (*_, val) in RUNS.items():
        every, steps = int(val[0].split("=")[1]), int(val[2].split("=")[1])
        for res in (runs["one"], runs["eight"][0]):
            metrics = res[name]["metrics"]
            assert [m["iteration"] for m in metrics] == list(range(1, steps + 1))
            assert sorted(_val_losses(metrics)) == list(range(every, steps + 1, every)), name
            for m in metrics:
                assert ("val_ppl" in m) == ("val_loss" in m)
                if "val_loss" in m:
                    assert m["val_ppl"] == math.exp(m["val_loss"])
                    assert math.isfinite(m["val_loss"]) and m["val_loss"] > 0


def test_training_is_unchanged_by_evaluating(runs):
    """The 1f1b run evaluates at step 2 and trains on: its losses match 1 process all along."""
    ref = [m["lm_loss"] for m in runs["one"]["llama 1f1b"]["metrics"]]
    got = [m["lm_loss"] for m in runs["eight"][0]["llama 1f1b"]["metrics"]]
    assert all(abs(g - r) <= TOL * r for g, r in zip(got, ref)), (got, ref)
    assert ref[3] < ref[0]
    for rank in runs["eight"]:
        assert rank["zbv zero1"]["not_at_rest"] == []  # FSDP parameters resharded after eval


def test_metrics_file_has_val_loss_on_the_evaluation_lines(runs):
    for world in (1, 8):
        lines = (runs["root"] / f"{world}-llama 1f1b.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        # logged every 3 steps (1, 4); the evaluation at step 2 is written anyway
        assert [r["iteration"] for r in records] == [1, 2, 4]
        assert [("val_loss" in r, "val_ppl" in r) for r in records] == [
            (False, False),
            (True, True),
            (True, True),
        ]
        res = runs["one"] if world == 1 else runs["eight"][0]
        assert _val_losses(res["llama 1f1b"]["metrics"]) == {
            r["iteration"]: r["val_loss"] for r in records if "val_loss" in r
        }
