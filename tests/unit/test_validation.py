"""Validation loss (`tokens.val_check_interval`, `tokens.limit_val_batches`).

In-process: the config checks; which samples are held out (dummy indices, Nanoset windows that
no stage trains on, the same whatever train_steps, the same batches at dp 1 and 2); the console
line. Forked ranks: one 1-rank launch and one 8-rank launch (dp2 x tp2 x pp2) run the same
three configs — Llama with 1f1b (torch's eval()), zbv_zero_bubble with zero_stage 1 (the
explicit forward walk, FSDP resharded after), Qwen2 with document masking — and an evaluation
of the initial weights done twice; val_loss must agree across layouts within 1e-5 and appear
exactly at the interval steps, in the records and in the metrics file.

The tests of this subject that need a process group are in
`tests/ranks/test_validation_ranks.py`."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from parity import TINY

from mesh3d.checks import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.data.build import StagedData
from mesh3d.data.hf import TokenWindows
from mesh3d.data.validation import DUMMY_OFFSET, source_key
from mesh3d.errors import UserError
from mesh3d.train.metrics import format_iteration_line

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
    ],
)  # fmt: skip
def test_settings_that_cannot_evaluate_are_refused(every, batches, steps, message):
    errors = validation_errors(_cfg(_val(every, batches, steps)), world_size=1)
    assert len(errors) == 1 and errors[0].startswith(message), errors


@pytest.mark.parametrize("every", [-1, 0])
def test_held_out_batches_that_never_run_are_a_warning_as_nanotron_accepts_them(every):
    from mesh3d.checks import config_warnings

    cfg = _cfg(_val(every, 3, 5))
    assert validation_errors(cfg, world_size=1) == []
    expect = f"`tokens.limit_val_batches` is 3 but `tokens.val_check_interval` is {every} (never)"
    assert any(w.startswith(expect) for w in config_warnings(cfg)), config_warnings(cfg)


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
