"""Nanotron pairs optimizer states with its parameters by position: the optimizer files mesh3d
writes for Qwen2 (with q/k/v bias) and Qwen2-MoE list their entries in Nanotron's own parameter
order, so every state tensor has its parameter's shape under that pairing (tp1, tp2, dp2 zero 1).

Nanotron's order is written out here from its source, independently of mesh3d's spec:
`models/qwen.py` (`Qwen2DecoderLayer` registers both norms before `attn`, so `named_parameters()`
yields `post_attention_layernorm` before the attention) and `nn/moe.py` (`Qwen2MoELayer`: router,
shared expert, shared-expert gate, experts). Nanotron's loader checks the saved names as a set,
then loads `state[i]` into its i-th parameter (issue 26: with Llama's order its first step fails
on `[64]` vs `[128, 64]`)."""

from __future__ import annotations

import json

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, train_runs
from test_moe import MOE
from test_qwen2 import QWEN

from mesh3d.checkpoint.nanotron_weights import local_shape, nanotron_params
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.models.registry import model_shape

EMB = "model.token_position_embeddings.pp_block.token_embedding.weight"
NORM = "model.final_layer_norm.pp_block.weight"
HEAD = "model.lm_head.pp_block.weight"
ATTN_NORMS = ["input_layernorm.weight", "post_attention_layernorm.weight"]
ATTN = ["attn.qkv_proj.weight", "attn.qkv_proj.bias", "attn.o_proj.weight"]
MLP = ["mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
MOE_MLP = ["mlp.router.weight", "mlp.shared_expert.gate_up_proj.weight",
           "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight",
           "mlp.experts.merged_gate_up_proj", "mlp.experts.merged_down_proj"]  # fmt: skip
ONE_STEP = ["tokens.train_steps=1", "checkpoints.checkpoint_interval=1"]
LAYOUTS = {"tp1": (1, 1, 0), "tp2": (1, 2, 0), "dp2 zero1": (2, 1, 1)}  # dp, tp, zero


def nanotron_order(cfg) -> list[str]:
    """Nanotron's `named_parameters()` order of a Qwen2 model (one pipeline stage)."""
    mc = cfg.model.model_config
    moe = set(mc.moe_config.layers) if mc.moe_config else set()
    out = [EMB]
    for i in range(mc.num_hidden_layers):
        attn = ATTN if mc.attention_bias else [n for n in ATTN if not n.endswith("bias")]
        layer = ATTN_NORMS + attn + (MOE_MLP if i in moe else MLP)
        out += [f"model.decoder.{i}.pp_block.{n}" for n in layer]
    return out + [NORM] + ([] if mc.tie_word_embeddings else [HEAD])


def _save(world: int, base: dict, layouts: list[str], root) -> None:
    runs = []
    for name in layouts:
        dp, tp, zero = LAYOUTS[name]
        path = root / name.replace(" ", "_")
        runs.append(layout_overrides(dp, tp, "ALL_REDUCE", zero, None) + ONE_STEP
                    + [f"checkpoints.checkpoints_path={path}"])  # fmt: skip
    run_ranks(world, train_runs, runs, base, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("order")
    out = {}
    for family, base in (("qwen2", QWEN), ("qwen2-moe", MOE)):
        _save(1, base, ["tp1"], root / family)
        _save(2, base, ["tp2", "dp2 zero1"], root / family)
        out[family] = (base, root / family)
    return out


def check_pairing(step, cfg, dp: int, tp: int, zero: bool) -> tuple[int, list[str]]:
    """Pair every optimizer file's states with Nanotron's parameters by position, as its loader
    does; (state tensors checked, mismatches as 'file: index name: state shape != param shape')."""
    order = nanotron_order(cfg)
    params = {p.name: p for p in nanotron_params(model_shape(cfg))}
    assert set(params) == set(order)  # the test's table names what mesh3d writes
    config = json.loads((step / "optimizer" / "optimizer_config.json").read_text())
    offsets = config["configs"].get("param_name_to_dp_rank_offsets", {})
    checked, bad = 0, []
    for t in range(tp):
        for d in range(dp):
            part = f"_dp-{d}-of-{dp}" if zero else ""
            file = f"optimizer_pp-0-of-1{part}_tp-{t}-of-{tp}_exp-0-of-1.pt"
            opt = torch.load(step / "optimizer" / file)
            assert set(opt["names"].values()) == set(order), file  # Nanotron's only name check
            for i, name in enumerate(order):
                shape = local_shape(params[name], tp)
                if zero:  # its live parameter is this dp rank's flat slice
                    start, end = (int(x) for x in offsets[name][str(d)])
                    shape = (end - start,)
                for key in ("exp_avg", "exp_avg_sq"):
                    got = tuple(opt["state"][i][key].shape)
                    checked += 1
                    if got != shape:
                        bad.append(f"{file}: {i} {name}: {got} != {shape}")
    return checked, bad


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["qwen2", "qwen2-moe"])
def test_optimizer_states_pair_with_nanotron_parameters_by_position(saved, family, layout):
    base, root = saved[family]
    dp, tp, zero = LAYOUTS[layout]
    cfg = apply_overrides(
        config_from_dict(base), layout_overrides(dp, tp, "ALL_REDUCE", zero, None)
    )
    checked, bad = check_pairing(root / layout.replace(" ", "_") / "1", cfg, dp, tp, bool(zero))
    print(f"\n{family} {layout}: {checked} state tensors paired by position, {len(bad)} mismatched")
    assert checked > 0 and bad == [], bad[:5]
