"""Validation loss (`tokens.val_check_interval`, `tokens.limit_val_batches`).

In-process: the config checks; which samples are held out (dummy indices, Nanoset windows that
no stage trains on, the same whatever train_steps, the same batches at dp 1 and 2); the console
line. Forked ranks: one 1-rank launch and one 8-rank launch (dp2 x tp2 x pp2) run the same
three configs — Llama with 1f1b (torch's eval()), zbv_zero_bubble with zero_stage 1 (the
explicit forward walk, FSDP resharded after), Qwen2 with document masking — and an evaluation
of the initial weights done twice; val_loss must agree across layouts within 1e-5 and appear
exactly at the interval steps, in the records and in the metrics file.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides
from test_qwen2 import QWEN

from mesh3d.checks import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.build import StagedData
from mesh3d.data.hf import TokenWindows
from mesh3d.data.validation import DUMMY_OFFSET, source_key
from mesh3d.errors import UserError
from mesh3d.train.metrics import format_iteration_line

TOL = 1e-5
GBS = 8  # TINY's global batch at every layout_overrides layout


def _cfg(overrides: list[str], base: dict = TINY):
    return apply_overrides(config_from_dict(copy.deepcopy(base)), overrides)


def _val(every: int, batches: int, steps: int) -> list[str]:
    return [
        f"tokens.val_check_interval={every}",
        f"tokens.limit_val_batches={batches}",
        f"tokens.train_steps={steps}",
    ]


# ---------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    "every, batches, steps, message",
    [
        (-2, 0, 5, "`tokens.val_check_interval` must be -1 or 0 (no validation) or a number of steps >= 1, got -2"),
        (2, 0, 5, "`tokens.val_check_interval` is 2 but `tokens.limit_val_batches` is 0"),
        (-1, 3, 5, "`tokens.limit_val_batches` is 3 but `tokens.val_check_interval` is -1 (never)"),
        (0, 3, 5, "`tokens.limit_val_batches` is 3 but `tokens.val_check_interval` is 0 (never)"),
        (6, 1, 5, "`tokens.val_check_interval` (6) is larger than `tokens.train_steps` (5)"),
    ],
)  # fmt: skip
def test_settings_that_cannot_evaluate_are_refused(every, batches, steps, message):
    errors = validation_errors(_cfg(_val(every, batches, steps)), world_size=1)
    assert len(errors) == 1 and errors[0].startswith(message), errors


@pytest.mark.parametrize("every, batches", [(-1, 0), (0, 0), (5, 1), (1, 2)])
def test_valid_settings_pass(every, batches):
    assert validation_errors(_cfg(_val(every, batches, 5)), world_size=1) == []


# ---------------------------------------------------------------- held-out samples


def test_dummy_validation_samples_are_a_fixed_region_never_trained_on():
    data = StagedData(_cfg(_val(2, 3, 5)))
    held = data.validation
    assert held.ids == list(range(DUMMY_OFFSET, DUMMY_OFFSET + 3 * GBS))  # training: 0..39
    assert held.num_batches == 3 and held.global_batch == GBS
    again = StagedData(_cfg(_val(1, 3, 9))).validation  # another run length: the same samples
    for i in (0, 23):
        assert all(torch.equal(a, b) for a, b in zip(held[i], again[i]))
    rnd = StagedData(_cfg(_val(2, 3, 5) + ["mesh3d.dummy_data=random"]))
    trained = {
        tuple(x.tolist()) for s in range(1, 6) for mb in rnd.batches(s, 0, 1, 2) for x in mb[0]
    }
    held_out = {tuple(rnd.validation[i][0].tolist()) for i in range(3 * GBS)}
    assert len(held_out) == 3 * GBS and not held_out & trained  # random tokens: other samples
    assert StagedData(_cfg(_val(-1, 0, 5))).validation is None


def test_dummy_keys_that_training_would_reach_are_refused():
    """A dummy stage whose seed puts its samples on the validation keys (torch's CPU generator
    keeps 32 bits of a seed: seed 3 + 2**31 draws what seed 3 draws at index + 2**31)."""
    d = copy.deepcopy(TINY)
    d["data_stages"].append(
        {"name": "late", "start_training_step": 3, "data": {"dataset": None, "seed": 3 + 2**31}}
    )
    late = StagedData(_cfg(_val(-1, 0, 5), d)).datasets[1]
    first = StagedData(_cfg(_val(1, 1, 5))).validation
    assert torch.equal(late[0][0], first[0][0])  # the collision is real
    with pytest.raises(UserError, match="would repeat training samples of data stage 'late'"):
        StagedData(_cfg(_val(1, 1, 5), d))


def _folder(path, samples: int, seq: int = 16, first: int = 0):
    """One .ds file of `samples` windows of seq + 1 distinct tokens (ids < 250)."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = (np.arange(samples * (seq + 1)) + first) % 250
    tokens.astype("<u2").tofile(path / "00000_unshuffled.ds")
    return path


def _stage(name: str, start: int, seed: int, folders: list, weights=None) -> dict:
    dataset = {"dataset_folder": [str(f) for f in folders], "dataset_weights": weights}
    return {"name": name, "start_training_step": start, "data": {"seed": seed, "dataset": dataset}}


def _nanoset_cfg(stages: list[dict], overrides: list[str]):
    d = copy.deepcopy(TINY)
    d["data_stages"] = stages
    return _cfg(overrides, d)


def _trained_windows(data: StagedData) -> set[tuple[str, int]]:
    """(folder, window) of every sample every stage reads in the run."""
    out = set()
    for i, ds in enumerate(data.datasets):
        steps = sum(1 for s in range(1, data.train_steps + 1) if data.stage_at(s) == i)
        for j in range(steps * data.gbs):
            k, w = ds.sample_source(j)
            out.add((source_key(ds.sources[k]), w))
    return out


def test_nanoset_validation_is_the_unread_tail_of_the_first_epoch(tmp_path):
    a = _folder(tmp_path / "a", 100)
    stages = [_stage("s", 1, 3, [a])]
    data = StagedData(_nanoset_cfg(stages, _val(2, 2, 5)))  # trains on 40 of 100 samples
    ds, held = data.datasets[0], data.validation
    which, sample = ds.epoch_sources(0, whole=True)
    tail = list(zip(which[::-1][:16].tolist(), sample[::-1][:16].tolist()))
    assert held.ids == tail
    assert not {(source_key(ds.sources[k]), w) for k, w in held.ids} & _trained_windows(data)
    longer = StagedData(_nanoset_cfg(stages, _val(2, 2, 10))).validation  # 80 of 100
    assert longer.ids == held.ids
    one = torch.cat([mb[0] for mb in held.batches(1, 0, 1, 2)])
    two = torch.cat([mb[0] for r in (0, 1) for mb in held.batches(1, r, 2, 2)])
    assert torch.equal(one, two)  # the same batch at dp 1 and dp 2
    assert torch.equal(one[0], held[8][0])
    with pytest.raises(UserError, match="tokens.limit_val_batches=2 asks for 16 held-out samples"):
        StagedData(_nanoset_cfg(stages, _val(2, 2, 11)))  # 88 read: 12 left


def test_stages_on_the_same_folder_in_another_order_are_excluded(tmp_path):
    a, b = _folder(tmp_path / "a", 60), _folder(tmp_path / "b", 30, first=7)
    stages = [
        _stage("first", 1, 3, [a]),
        _stage("blend", 3, 5, [a, b], [0.8, 0.2]),  # other seed and blend, a oversampled
    ]
    data = StagedData(_nanoset_cfg(stages, _val(1, 1, 5)))  # 16 + 24 samples read
    ds0, held = data.datasets[0], data.validation
    keys = [(source_key(ds0.sources[k]), w) for k, w in held.ids]
    assert len(keys) == len(set(keys)) == GBS
    assert not set(keys) & _trained_windows(data)
    which, sample = ds0.epoch_sources(0, whole=True)
    tail = list(zip(which[::-1][:GBS].tolist(), sample[::-1][:GBS].tolist()))
    assert held.ids != tail  # the blend stage reaches some of stage 0's last windows


def test_in_memory_tokens_are_identified_by_content():
    tokens = np.arange(100, dtype=np.uint16)
    same, other = TokenWindows(tokens.copy(), 9), TokenWindows(tokens[::-1].copy(), 9)
    assert source_key(TokenWindows(tokens, 9)) == source_key(same) != source_key(other)


def test_console_line_shows_the_validation_items():
    m = {"iteration": 4, "lm_loss": 2.71, "val_loss": 2.5, "val_ppl": math.exp(2.5)}
    assert format_iteration_line(m, 10).endswith("lm_loss: 2.71 | val_loss: 2.5 | val_ppl: 12.2")


# ---------------------------------------------------------------- at every layout


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
