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
from safetensors import safe_open

from mesh3d.checkpoint import nanotron_params, read_nanotron_weights
from mesh3d.checkpoint.nanotron_weights import shard_of, weight_file
from mesh3d.checkpoint.training import resolve_step_dir
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import UserError
from mesh3d.models.registry import model_shape

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


V250 = ["model.model_config.vocab_size=250", "parallelism.tp_mode=ALL_REDUCE"]


def _as_if_nanotron_wrote_it(src, dst):
    """A copy of a (1,1,1) zero-0 step folder changed into what Nanotron 1.5 (HEAD) writes:
    no manifest, pickled random-state classes, an LR-scheduler state with one group per parameter, metadata
    without mesh3d's custom_metas and with HEAD's extra fields."""
    import pickle
    import shutil

    shutil.copytree(src, dst)
    (dst / "mesh3d_manifest.json").unlink()  # Nanotron writes no manifest
    for f in (dst / "random").glob("*.pt"):
        f.write_bytes(pickle.dumps(NanotronRandomStates(tp_synced=("state", 1))))
    sched = dst / "lr_scheduler" / "lr_scheduler_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt"
    sd = torch.load(sched, weights_only=True)
    n = 11  # Nanotron builds one param group per parameter
    torch.save(
        {"base_lrs": [sd["base_lrs"][0]] * n, "last_epoch": sd["last_epoch"], "verbose": False,
         "_step_count": sd["_step_count"], "_get_lr_called_within_step": False,
         "_last_lr": [sd["_last_lr"][0]] * n, "lr_lambdas": [{}] * n},
        sched,
    )  # fmt: skip
    meta_path = dst / "checkpoint_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta.update(version="1.5", cp=1, custom_metas=None)
    meta["metas"]["consumed_tokens_total"] = None
    for stage in meta["metas"]["data_stages"]:
        stage.update(sequence_length=16, consumed_tokens_per_dataset_folder={})
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True))


class NanotronRandomStates(dict):
    """Stands for nanotron.random.RandomStates: a pickled class mesh3d must never unpickle."""


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
    # vocab 250 pads to 250 at tp 1 and to 252 at tp 4: resume across a padding change
    v250 = _layout(1, 1, 1, zero=0) + V250
    first = run_ranks(
        1,
        train_runs,
        [v250 + _ckpt(d / "v250s", 100, 8), v250 + _ckpt(d / "v250", 4, 4)],
        timeout=200,
    )[0]
    _as_if_nanotron_wrote_it(d / "v250" / "4", d / "nanotron" / "4")
    four = run_ranks(
        4,
        train_runs,
        [
            _layout(2, 2, 1) + _ckpt(d / "r221", 100, 8, saved),
            _layout(1, 4, 1, "ALL_REDUCE", 0) + V250 + _ckpt(d / "r141", 100, 8, d / "v250"),
        ],
        timeout=200,
    )[0]
    fresh = ["checkpoints.load_optimizer=false", "checkpoints.load_lr_scheduler=false"]
    ones = [
        _layout(1, 1, 1) + _ckpt(d / "r111", 100, 8, saved),
        _layout(1, 1, 1)
        + _ckpt(d / "init", 100, 3)
        + [f"model.init_method={{path: {saved / '4'}}}"],
        _layout(1, 1, 1) + _ckpt(d / "weights", 100, 3, saved / "4") + fresh,
        v250 + _ckpt(d / "from_nanotron", 100, 8, d / "nanotron" / "4"),
    ]
    one = run_ranks(1, train_runs, ones, timeout=200)[0]
    names = ["straight", "first4", "same", "(1,4,2)", "(4,1,2)"]
    return (
        dict(zip(names, out))
        | {"(2,2,1)": four[0], "(1,1,1)": one[0], "dir": saved}
        | {"init_path": one[1], "weights_only": one[2]}
        | {"v250_straight": first[0], "v250_tp4": four[1], "from_nanotron": one[3]}
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
        "consumed_tokens_total": None,  # HEAD: the sum of the (empty) per-folder counts
        "consumed_train_samples": 32,
        "data_stages": [{"consumed_train_samples": 32, "name": "s", "start_training_step": 1,
                         "sequence_length": 16, "consumed_tokens_per_dataset_folder": {}}],
        "last_stage_idx": 0,
        "last_train_step": 4,
    }  # fmt: skip
    assert (meta["version"], meta["tp"], meta["dp"], meta["cp"]) == ("1.4", 2, 2, 1)
    mesh3d = {"device": "cpu", "dummy_data": "learnable"}  # config.yaml has no mesh3d section
    assert meta["custom_metas"] == {"writer": "mesh3d", "pp": 2, "zero_stage": 1, "mesh3d": mesh3d}
    for pp in range(2):
        for tp in range(2):
            name = f"lr_scheduler_pp-{pp}-of-2_tp-{tp}-of-2_exp-0-of-1.pt"
            sd = torch.load(step / "lr_scheduler" / name, weights_only=True)
            assert sd["last_epoch"] == 4
            # one entry per parameter of that rank's optimizer files (Nanotron's shape)
            opt = f"optimizer_pp-{pp}-of-2_dp-0-of-2_tp-{tp}-of-2_exp-0-of-1.pt"
            names = torch.load(step / "optimizer" / opt, weights_only=True)["names"]
            assert len(sd["base_lrs"]) == len(sd["_last_lr"]) == len(names)
    assert not list(root.glob(".tmp-*")), "no temporary folder left behind"
    # the Nanotron-layout weights equal the model's weights after step 4
    from parity import TINY

    cfg = apply_overrides(config_from_dict(TINY), _layout(2, 2, 2))
    shape = model_shape(cfg)
    weights = read_nanotron_weights(step / "model", shape)
    # the files the 8 ranks wrote are exactly the spec's tree (its listing is checked by hand in
    # test_checkpoint_layout.py), with the same metadata strings
    expected = {}
    for p in nanotron_params(shape, 2):
        for t in range(1 if p.kind == "replicated" else 2):
            expected[weight_file(p, t, 2, 2)] = p
    files = {str(f.relative_to(step / "model")): f for f in (step / "model").rglob("*")}
    files = {k: v for k, v in files.items() if v.is_file()}
    assert set(files) == set(expected)
    for rel, p in expected.items():
        t = int(rel.split("tp-rank-")[1].split("-")[0]) if "tp-rank-" in rel else 0
        with safe_open(str(files[rel]), framework="pt") as f:
            meta = f.metadata() or {}
        assert meta == shard_of(p, torch.zeros(p.shape), t, 2)[1], rel
    for name, w in runs["first4"]["weights"].items():
        assert torch.equal(weights[name].to(w.dtype), w), name


def test_resume_path_errors(tmp_path, runs):
    with pytest.raises(UserError, match="neither a step folder"):
        resolve_step_dir(tmp_path)
    (tmp_path / "latest.txt").write_text("9")
    with pytest.raises(UserError, match="names step folder"):
        resolve_step_dir(tmp_path)
    assert resolve_step_dir(runs["dir"]) == runs["dir"] / "4"


def test_resume_across_vocab_padding_change(runs):
    # saved at tp 1 (250 rows), resumed at tp 4 (252 rows): padding rows are zero, never trained
    ref = torch.tensor(runs["v250_straight"]["loss"][4:])
    got = torch.tensor(runs["v250_tp4"]["loss"])
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, (got, ref)


def test_resume_from_a_checkpoint_nanotron_wrote(runs):
    # pickled random states ignored, per-parameter LR groups, version 1.5 metadata: still exact
    assert runs["from_nanotron"]["loss"] == runs["v250_straight"]["loss"][4:]
    assert runs["from_nanotron"]["grad_norm"] == runs["v250_straight"]["grad_norm"][4:]


def test_training_state_files(runs):
    step = runs["dir"] / "4"
    opt = sorted(f.name for f in (step / "optimizer").iterdir())
    expected = [
        f"optimizer_pp-{p}-of-2_dp-{d}-of-2_tp-{t}-of-2_exp-0-of-1.pt"
        for p in range(2) for d in range(2) for t in range(2)
    ]  # fmt: skip
    assert opt == sorted(expected + ["optimizer_config.json"])
    rnd = sorted(f.name for f in (step / "random").iterdir())
    assert rnd == sorted(
        f"tp-{t}-of-2_dp-{d}-of-2_pp-{p}-of-2.pt"
        for p in range(2)
        for d in range(2)
        for t in range(2)
    )
    config = json.loads((step / "optimizer" / "optimizer_config.json").read_text())
    assert config["type"] == "ZeroDistributedOptimizer"
    assert config["parallelism"] == {
        "tp_size": "2", "dp_size": "2", "pp_size": "2", "expert_parallel_size": "1"
    }  # fmt: skip
    qkv = "model.decoder.0.pp_block.attn.qkv_proj.weight"  # tp-local (32+16+16, 64): 4096 each
    assert config["configs"]["orig_param_shapes"][qkv] == ["64", "64"]
    assert config["configs"]["param_name_to_dp_rank_offsets"][qkv] == {
        "0": ["0", "2048"], "1": ["2048", "4096"]
    }  # fmt: skip
    payload = torch.load(step / "optimizer" / expected[0], weights_only=True)
    names = payload["names"]
    assert names[0] == "model.token_position_embeddings.pp_block.token_embedding.weight"
    assert qkv in names.values()
    assert len(payload["param_groups"]) == len(names)
    assert all(g["params"] == [i] for i, g in enumerate(payload["param_groups"]))
    i = next(k for k, v in names.items() if v == qkv)
    assert set(payload["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
    assert payload["state"][i]["exp_avg"].shape == (2048,)  # this dp rank's flat slice
    assert "gradient_accumulator" not in payload  # fp32 model: the weights are the masters
    assert float(payload["state"][i]["step"]) == 4
    # ZeRO-0 (dp rank 0 only, whole tp-local tensors) from the (1,1,1) zero-0 run
    z0 = runs["dir"].parent / "v250" / "4" / "optimizer"
    assert sorted(f.name for f in z0.iterdir()) == [
        "optimizer_config.json", "optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt"
    ]  # fmt: skip
    assert json.loads((z0 / "optimizer_config.json").read_text())["configs"] == {}
