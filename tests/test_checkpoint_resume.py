"""Checkpoints in training: exact resume, resume at other layouts, the step folder's contents.

One 8-rank launch at (dp, tp, pp) = (2, 2, 2) (REDUCE_SCATTER, zero 1, tied embeddings, 1f1b):
train 8 steps straight; train 4 steps saving at step 4; resume from it to 8 — steps 5-8 must
be bitwise equal to the straight run. Then resume the same step-4 checkpoint at (1,4,2),
(4,1,2) (same launch), (2,2,1) and (1,1,1): steps 5-8 within 1e-5.
"""

import json

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, train_runs

from mesh3d.checkpoint import ModelShape, read_nanotron_weights
from mesh3d.checkpoint.resume import resolve_step_dir
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import UserError

# vocab 256 pads to the same size at every tp here, so any layout can load the checkpoint
COMMON = ["model.model_config.vocab_size=256", "model.model_config.num_hidden_layers=4"]


def _layout(dp, tp, pp, mode="REDUCE_SCATTER", zero=1):
    return layout_overrides(dp, tp, mode, zero, True) + [f"parallelism.pp={pp}"] + COMMON


def _ckpt(path, interval, steps, resume=None):
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={interval}"]
    out.append(f"tokens.train_steps={steps}")
    if resume:
        out.append(f"checkpoints.resume_checkpoint_path={resume}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    saved = d / "main"
    eight = [
        _layout(2, 2, 2) + _ckpt(d / "straight", 100, 8),
        _layout(2, 2, 2) + _ckpt(saved, 4, 4),
        _layout(2, 2, 2) + _ckpt(d / "same", 100, 8, resume=saved),
        _layout(1, 4, 2) + _ckpt(d / "r142", 100, 8, resume=saved / "4"),
        _layout(4, 1, 2, "ALL_REDUCE", 0) + _ckpt(d / "r412", 100, 8, resume=saved / "4"),
    ]
    out = run_ranks(8, train_runs, eight, timeout=400)[0]
    four = run_ranks(
        4, train_runs, [_layout(2, 2, 1) + _ckpt(d / "r221", 100, 8, saved)], timeout=200
    )
    fresh = ["checkpoints.load_optimizer=false", "checkpoints.load_lr_scheduler=false"]
    ones = [
        _layout(1, 1, 1) + _ckpt(d / "r111", 100, 8, saved),
        _layout(1, 1, 1)
        + _ckpt(d / "init", 100, 3)
        + [f"model.init_method={{path: {saved / '4'}}}"],
        _layout(1, 1, 1) + _ckpt(d / "weights", 100, 3, saved / "4") + fresh,
    ]
    one = run_ranks(1, train_runs, ones, timeout=200)[0]
    names = ["straight", "first4", "same", "(1,4,2)", "(4,1,2)"]
    return (
        dict(zip(names, out))
        | {"(2,2,1)": four[0][0], "(1,1,1)": one[0], "dir": saved}
        | {"init_path": one[1], "weights_only": one[2]}
    )


def test_exact_resume_same_layout_is_bitwise(runs):
    straight, first, same = runs["straight"], runs["first4"], runs["same"]
    assert first["loss"] == straight["loss"][:4]
    assert same["loss"] == straight["loss"][4:]  # bitwise: floats compared with ==
    assert same["grad_norm"] == straight["grad_norm"][4:]


@pytest.mark.parametrize("layout", ["(1,4,2)", "(4,1,2)", "(2,2,1)", "(1,1,1)"])
def test_resume_at_another_layout(runs, layout):
    ref = torch.tensor(runs["straight"]["loss"][4:])
    got = torch.tensor(runs[layout]["loss"])
    assert got.shape == ref.shape
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, (layout, got, ref)


def test_init_method_path_starts_from_checkpoint_weights(runs):
    # init_method {path: <step>} (Nanotron's ExistingCheckpointInit, read from the Nanotron-layout
    # weights at another layout) == resuming with load_optimizer/load_lr_scheduler false (the
    # DCP state): the same weights, a fresh optimizer and schedule, step count from 1
    a, b = runs["init_path"], runs["weights_only"]
    assert len(a["loss"]) == 3
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert abs(a["loss"][0] - runs["straight"]["loss"][4]) > 1e-4  # other data at step 1


def test_step_folder_contents(runs):
    root = runs["dir"]
    assert (root / "latest.txt").read_text() == "4"
    step = root / "4"
    meta = json.loads((step / "checkpoint_metadata.json").read_text())
    assert meta["metas"] == {
        "consumed_train_samples": 32,
        "data_stages": [{"consumed_train_samples": 32, "name": "s", "start_training_step": 1}],
        "last_stage_idx": 0,
        "last_train_step": 4,
    }
    assert (meta["version"], meta["tp"], meta["dp"]) == ("1.4", 2, 2)
    assert meta["custom_metas"] == {"writer": "mesh3d", "pp": 2, "zero_stage": 1}
    for pp in range(2):
        for tp in range(2):
            name = f"lr_scheduler_pp-{pp}-of-2_tp-{tp}-of-2_exp-0-of-1.pt"
            sd = torch.load(step / "lr_scheduler" / name, weights_only=True)
            assert sd["last_epoch"] == 4
    assert not list(root.glob(".tmp-*")), "no temporary folder left behind"
    # the Nanotron-layout weights equal the model's weights after step 4
    from parity import TINY

    cfg = apply_overrides(config_from_dict(TINY), _layout(2, 2, 2))
    weights = read_nanotron_weights(step / "model", ModelShape.from_config(cfg))
    for name, w in runs["first4"]["weights"].items():
        assert torch.equal(weights[name].to(w.dtype), w), name


def test_resume_path_errors(tmp_path, runs):
    with pytest.raises(UserError, match="neither a step folder"):
        resolve_step_dir(tmp_path)
    (tmp_path / "latest.txt").write_text("9")
    with pytest.raises(UserError, match="names step folder"):
        resolve_step_dir(tmp_path)
    assert resolve_step_dir(runs["dir"]) == runs["dir"] / "4"
