"""Nanotron's own classic tiny_llama config trains in mesh3d, and Nanotron can resume what mesh3d
saves: every file of a step folder checked against what Nanotron's loader asserts and does
(facts from its source; Nanotron itself needs CUDA, so its loading is re-enacted with torch).

One 8-rank launch at the config's own dp2 x tp2 x pp2 (bf16 with fp32 masters, tied, 1f1b with 1
microbatch): A = the config as is, saving at step 3 (ZeRO-0); B = ZeRO-1 with weight-decay
exclusions, 4 steps straight; C = the same saving at step 2; D = resuming C to step 4. One
1-rank launch: A at 1x1x1 (loss parity) and C resumed at 1x1x1.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_nanotron_roundtrip_unit.py`."""

import functools
import json

import pytest
import torch
import yaml
from dist import run_ranks
from nanotron_fixtures import FIXTURES, needs_fixtures
from nanotron_keys import config_key_problems
from parity import train_runs

from mesh3d.checks import validate
from mesh3d.config import (
    apply_overrides,
    config_from_dict,
    load_config,
)
from mesh3d.train.lr_schedule import lr_at, schedule_kwargs

pytestmark = needs_fixtures

CLASSIC = FIXTURES / "classic-config_tiny_llama.yaml"
PEAK = 3e-4
EMB = "model.token_position_embeddings.pp_block.token_embedding.weight"
NORM = "model.final_layer_norm.pp_block.weight"
LAYER = {  # Nanotron's registration order in a decoder layer, tp-local shapes at tp 2
    "input_layernorm.weight": (16,),
    "attn.qkv_proj.weight": (24, 16),
    "attn.o_proj.weight": (16, 8),
    "post_attention_layernorm.weight": (16,),
    "mlp.gate_up_proj.weight": (64, 16),
    "mlp.down_proj.weight": (16, 32),
}
SHAPES = {EMB: (128, 16), NORM: (16,)} | {
    f"model.decoder.{i}.pp_block.{k}": s for i in (0, 1) for k, s in LAYER.items()
}
# Nanotron's optimizer order per pp rank: module order; the tied lm_head copy last, as EMB
ORDER = {0: [EMB, *[n for n in SHAPES if n.startswith("model.decoder.")]], 1: [NORM, EMB]}
EXCLUDE = [r"model\.final_layer_norm\.", r"model\.token_position_embeddings\."]
NO_DECAY = {EMB, NORM}  # what EXCLUDE matches (Nanotron names; mesh3d's are not these)

DATA = ["data_stages[0].data.dataset=null", "data_stages[1].data.dataset=null"]
DATA += ["tokens.sequence_length=32", "mesh3d.device=cpu", "logging.log_level=warning"]
ONE = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "tokens.micro_batch_size=4"]
QUOTED = ", ".join(f"'{p}'" for p in EXCLUDE)  # YAML single quotes keep the backslashes
RT = ["optimizer.zero_stage=1", f"optimizer.weight_decay_exclude_named_params=[{QUOTED}]"]


def _ckpt(path, interval, steps, resume=None):
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={interval}"]
    out += [f"tokens.train_steps={steps}"]
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _base() -> dict:
    return yaml.safe_load(CLASSIC.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("roundtrip")
    eight = [
        DATA + _ckpt(d / "A", 3, 3),
        DATA + RT + _ckpt(d / "B", 100, 4),
        DATA + RT + _ckpt(d / "C", 2, 2),
        DATA + RT + _ckpt(d / "D", 100, 4, d / "C" / "2"),
    ]
    a, b, c, r = run_ranks(8, train_runs, eight, base=_base(), timeout=300)[0]
    ones = [DATA + ONE + _ckpt(d / "E", 100, 3), DATA + RT + ONE + _ckpt(d / "F", 100, 4, d / "C")]
    e, f = run_ranks(1, train_runs, ones, base=_base(), timeout=200)[0]
    cfg = apply_overrides(config_from_dict(_base()), eight[0])
    return dict(A=a, B=b, C=c, D=r, E=e, F=f, a_dir=d / "A" / "3", c_dir=d / "C" / "2", cfg=cfg)


def test_classic_tiny_llama_trains_at_its_world_size_like_one_process(runs):
    got, ref = torch.tensor(runs["A"]["loss"]), torch.tensor(runs["E"]["loss"])
    assert got.shape == (3,) and bool(torch.isfinite(got).all())
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, (got, ref)
    assert runs["A"]["replica_mismatches"] == []


def test_mesh3d_resumes_its_nanotron_shaped_checkpoint_exactly(runs):
    assert runs["C"]["loss"] == runs["B"]["loss"][:2]
    assert runs["D"]["loss"] == runs["B"]["loss"][2:]  # bitwise
    assert runs["D"]["grad_norm"] == runs["B"]["grad_norm"][2:]
    got, ref = torch.tensor(runs["F"]["loss"]), torch.tensor(runs["B"]["loss"][2:])
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5, (got, ref)  # at 1x1x1


def _files(step, zero):
    """{(pp, tp): (scheduler state, [optimizer payloads of that (pp, tp), one per dp file])}."""
    out = {}
    for pp in range(2):
        for tp in range(2):
            sched = torch.load(
                step / f"lr_scheduler/lr_scheduler_pp-{pp}-of-2_tp-{tp}-of-2_exp-0-of-1.pt"
            )
            dps = [f"_dp-{d}-of-2" for d in range(2)] if zero else [""]
            opts = [torch.load(step / f"optimizer/optimizer_pp-{pp}-of-2{x}_tp-{tp}-of-2_exp-0-of-1.pt")
                    for x in dps]  # fmt: skip
            out[pp, tp] = sched, opts
    return out


@pytest.mark.parametrize("which", ["a_dir", "c_dir"])
def test_optimizer_and_scheduler_files_as_nanotron_loads_them(runs, which):
    step, zero = runs[which], which == "c_dir"
    last = 3 if which == "a_dir" else 2
    kw = schedule_kwargs(runs["cfg"])
    for (pp, _), (sched, opts) in _files(step, zero).items():
        for opt in opts:
            names = [opt["names"][i] for i in range(len(opt["names"]))]
            assert names == ORDER[pp]  # positions are what Nanotron's loader pairs
            n = len(names)
            # NamedOptimizer.load_state_dict: a state entry per name, the same keys in each
            assert len(opt["state"]) == n > 0
            assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in opt["state"].values())
            assert set(opt["gradient_accumulator"]) == set(names)  # bf16 + fp32 masters
            assert len(opt["param_groups"]) == n
            for i, g in enumerate(opt["param_groups"]):
                assert g["params"] == [i]
                assert g["lr"] == g["initial_lr"] == PEAK  # the peak: see state.py
                assert (g["betas"], g["eps"], g["fused"]) == ((0.9, 0.95), 1e-8, True)
                wd = 0.0 if zero and names[i] in NO_DECAY else 0.01
                assert g["weight_decay"] == wd, names[i]
            _nanotron_resume(opt, sched, ORDER[pp], zero, kw)
        assert sched["base_lrs"] == [PEAK] * n and sched["lr_lambdas"] == [{}] * n
        assert sched["_last_lr"] == [pytest.approx(lr_at(last, **kw), rel=1e-12)] * n
        assert (sched["last_epoch"], sched["_step_count"]) == (last, last + 1)
        assert sched["_is_initial"] is False and sched["_get_lr_called_within_step"] is False


def _nanotron_resume(opt, sched, names, zero, kw):
    """What Nanotron's trainer does with these files: its optimizer (one group per parameter
    in `names` order, fp32 masters of the tp-local shapes, or their flat ZeRO-1 slices) checks
    the saved names as a set, loads the state by position and adopts the saved groups; then a
    LambdaLR with one lambda per group, each `initial_lr=group["lr"]`, loads the scheduler file
    and takes its initial step."""
    assert set(opt["names"].values()) == set(names)
    live = []
    for name in names:
        shape = SHAPES[name]
        if zero:  # this dp rank's slice: ceil(n / 2) elements (every size here is even)
            shape = (torch.Size(shape).numel() // 2,)
        live.append(torch.nn.Parameter(torch.zeros(shape)))
    optimizer = torch.optim.AdamW([{"params": [p]} for p in live], lr=PEAK, fused=True)
    optimizer.load_state_dict({"state": opt["state"], "param_groups": opt["param_groups"]})
    for p in live:
        assert optimizer.state[p]["exp_avg"].shape == p.shape
        p.grad = torch.zeros_like(p)
    optimizer.step()  # a misplaced state would fail here on its shape

    def factor(k, initial_lr):
        return lr_at(k, **kw) / initial_lr

    lambdas = [functools.partial(factor, initial_lr=g["lr"]) for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    scheduler.load_state_dict(sched)  # strict zips need one entry per group
    scheduler._initial_step()
    # Nanotron's known quirk: the resumed run is one schedule step ahead, not decayed twice
    expect = lr_at(sched["last_epoch"] + 1, **kw)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(expect)] * len(names)


@pytest.mark.parametrize("which", ["a_dir", "c_dir"])
def test_metadata_has_nanotron_fields_and_types(runs, which):
    step = runs[which]
    text = (step / "checkpoint_metadata.json").read_text()
    meta = json.loads(text)
    assert text == json.dumps(meta, indent=2, sort_keys=True)
    assert set(meta) == {"version", "tp", "dp", "cp", "metas", "custom_metas"}
    assert (meta["version"], meta["tp"], meta["dp"], meta["cp"]) == ("1.4", 2, 2, 1)
    metas = meta["metas"]
    assert set(metas) == {"consumed_train_samples", "last_train_step", "consumed_tokens_total",
                          "last_stage_idx", "data_stages"}  # fmt: skip
    last = 3 if which == "a_dir" else 2
    assert (metas["last_train_step"], metas["consumed_train_samples"]) == (last, 4 * last)
    assert metas["consumed_tokens_total"] is None and metas["last_stage_idx"] == 0
    stages = metas["data_stages"]
    assert [s["name"] for s in stages] == ["Stable Training Stage", "Annealing Phase"]
    for s, start, consumed in zip(stages, (1, 10), (4 * last, 0)):
        assert s == {"name": s["name"], "start_training_step": start, "sequence_length": 32,
                     "consumed_train_samples": consumed, "consumed_tokens_per_dataset_folder": {}}  # fmt: skip
    assert metas["consumed_train_samples"] == sum(s["consumed_train_samples"] for s in stages)
    zero = 1 if which == "c_dir" else 0
    assert meta["custom_metas"] == {"writer": "mesh3d", "pp": 2, "zero_stage": zero,
                                    "mesh3d": {"device": "cpu"}}  # fmt: skip


@pytest.mark.parametrize("which", ["a_dir", "c_dir"])
def test_step_config_yaml_parses_under_nanotron_schema(runs, which):
    step = runs[which]
    d = yaml.safe_load((step / "config.yaml").read_text())
    assert config_key_problems(d) == []
    last = 3 if which == "a_dir" else 2
    assert (d["general"]["step"], d["general"]["consumed_train_samples"]) == (last, 4 * last)
    assert [s["sequence_length"] for s in d["data_stages"]] == [32, 32]
    assert "mesh3d" not in d and "moe_layer_recompute" not in d["parallelism"]
    # and mesh3d reads it back (its mesh3d settings are in the metadata's custom_metas)
    cfg = load_config(step / "config.yaml", ["mesh3d.device=cpu"])
    validate(cfg, world_size=8)
    assert cfg.optimizer.zero_stage == (1 if which == "c_dir" else 0)
