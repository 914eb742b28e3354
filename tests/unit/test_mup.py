"""Spectral µP (`model.init_method: {use_mup: true}`): the initial full tensors have the std of
the formula (within 2%, widths 256 and 1024), each parameter trains at its own learning rate
(lr · fan_out / fan_in of Nanotron's fused matrices) on Nanotron's per-group schedule, the LR
scheduler file holds them as Nanotron writes it, and a tp 2 x pp 2 run equals one process.

The tests of this subject that need a process group are in `tests/ranks/test_mup_ranks.py`."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from parity import TINY

from mesh3d.checks import validation_errors
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.layout import RunLayout
from mesh3d.models.mup import spectral_std
from mesh3d.models.registry import model_shape, spec_of
from mesh3d.train.build import initial_weights
from mesh3d.train.lr_schedule import lr_at, schedule_kwargs
from mesh3d.train.optim import build_optimizer

MUP = copy.deepcopy(TINY)
MUP["model"]["init_method"] = {"use_mup": True}


def _cfg(*overrides: str, base: dict = MUP):
    return apply_overrides(config_from_dict(copy.deepcopy(base)), list(overrides))


def _wide(width: int):
    heads = 8
    return _cfg(f"model.model_config.hidden_size={width}",
                f"model.model_config.intermediate_size={4 * width}",
                f"model.model_config.num_attention_heads={heads}",
                "model.model_config.num_key_value_heads=4",
                "model.model_config.vocab_size=1000", "model.make_vocab_size_divisible_by=1")  # fmt: skip


@pytest.mark.parametrize("width", [256, 1024])
def test_initial_std_of_every_parameter_is_the_formula(width):
    cfg = _wide(width)
    h, f, dh = width, 4 * width, width // 8
    expected = {  # (fan_in, fan_out) of Nanotron's fused matrices
        "self_attn.q_proj.weight": spectral_std(h, (8 + 2 * 4) * dh),
        "self_attn.k_proj.weight": spectral_std(h, (8 + 2 * 4) * dh),
        "self_attn.o_proj.weight": spectral_std(h, h),
        "mlp.gate_proj.weight": spectral_std(h, 2 * f),
        "mlp.down_proj.weight": spectral_std(f, h),
    }
    assert expected["mlp.down_proj.weight"] == pytest.approx(1 / math.sqrt(f) * math.sqrt(h / f))
    source = initial_weights(cfg, RunLayout.of(cfg))
    shapes = spec_of(cfg.model.model_config).param_shapes(model_shape(cfg))
    measured = {}
    for name, shape in shapes.items():
        t = source(name, shape)
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones(shape)), name
            continue
        measured[name] = float(t.std())
        if name == "embed_tokens.weight":
            want = 1.0
        elif name == "lm_head.weight":
            want = spectral_std(h, 1000)
        else:  # v shares q/k's fused qkv matrix, up shares gate's gate_up
            leaf = name.split(".", 2)[2].replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            want = expected[leaf]
        assert abs(measured[name] / want - 1) < 0.02, (name, measured[name], want)
    assert len(measured) == 2 * 7 + 2


def test_each_parameter_trains_at_its_own_rate_on_nanotrons_schedule():
    cfg = _cfg("optimizer.learning_rate_scheduler.lr_warmup_steps=2",
               "optimizer.learning_rate_scheduler.lr_warmup_style=linear",
               "tokens.train_steps=10")  # fmt: skip
    model = spec_of(cfg.model.model_config).build(cfg.model.model_config, vocab_size=250)
    optimizer, scheduler = build_optimizer(
        model.named_parameters(), cfg, RunLayout.of(cfg), torch.device("cpu")
    )
    lr = cfg.optimizer.learning_rate_scheduler.learning_rate
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    h, f, q, kv = 64, 128, 64, 32  # TINY: 8 heads of 8, 4 kv heads
    scale = {"layers.0.self_attn.k_proj.weight": (q + 2 * kv) / h,
             "layers.1.mlp.up_proj.weight": 2 * f / h, "layers.0.mlp.down_proj.weight": h / f,
             "layers.0.self_attn.o_proj.weight": 1.0, "lm_head.weight": 250 / h,
             "embed_tokens.weight": 1.0, "norm.weight": 1.0}  # fmt: skip
    params = dict(model.named_parameters())
    for name, s in scale.items():
        assert group_of[id(params[name])]["initial_lr"] == pytest.approx(lr * s), name
    assert optimizer.param_groups[0]["lr_scale"] == 1.0  # the logged lr is the configured one
    kw = schedule_kwargs(cfg)
    for k in range(1, 10):
        optimizer.step()
        scheduler.step()
        for name, s in scale.items():  # Nanotron: each group warms up to its own peak, then
            want = lr_at(k, **{**kw, "learning_rate": lr * s})  # decays to the same min
            assert group_of[id(params[name])]["lr"] == pytest.approx(want), (name, k)


def test_refusals_name_the_family_and_the_parameter():
    from test_moe import MOE

    moe = copy.deepcopy(MOE)
    moe["model"]["init_method"] = {"use_mup": True}
    (msg,) = [e for e in validation_errors(_cfg(base=moe), world_size=1) if "use_mup" in e]
    assert "no rule for model.decoder.0.pp_block.mlp.router.weight" in msg
