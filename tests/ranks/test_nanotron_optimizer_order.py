"""Nanotron pairs optimizer states with its parameters by position: the optimizer and LR
scheduler files mesh3d writes list their entries in Nanotron's own parameter order, for every
family Nanotron has (Llama, Qwen2 with q/k/v bias, Qwen2-MoE, Starcoder2 with multi-query and
with grouped-query attention), so every state tensor has its parameter's shape under that
pairing (tp1, tp2, tp2 REDUCE_SCATTER, dp2 zero 1).

Nanotron's order is written out here from its source, independently of mesh3d's spec:
- `models/llama.py`: a decoder layer registers `input_layernorm`, `attn`,
  `post_attention_layernorm`, `mlp`;
- `models/qwen.py`: `Qwen2DecoderLayer` registers both norms before `attn`, and `nn/moe.py`'s
  `Qwen2MoELayer` the router, shared expert, shared-expert gate, experts;
- `models/starcoder2.py`: `GPTBlock` registers `ln_1`, `attn`, `ln_2`, `ff`; multi-query
  attention's `MQAColumnLinears` keeps `q` and `kv` in `nn.ParameterDict`s built from plain
  dicts, which torch orders by key (bias before weight);
- `parallel/tensor_parallel/nn.py`: `TensorParallelRowLinear` creates its bias on tp rank 0
  only, so a tp rank > 0 has no row-parallel bias (Starcoder2's `attn.o`/`attn.dense` and
  `ff.c_proj`) and its files have fewer entries.
Nanotron's loader checks the saved names as a set, then loads `state[i]` into its i-th
parameter (issue 26: with Llama's order its first step fails on `[64]` vs `[128, 64]`); its LR
scheduler zips the saved lists with its own param groups (`Elements don't match` otherwise)."""

from __future__ import annotations

import json

import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides, train_runs
from test_moe import MOE
from test_qwen2 import QWEN
from test_starcoder2 import STAR

from mesh3d.checkpoint.nanotron_weights import local_shape, nanotron_params
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.models.registry import model_shape

LLAMA_EMB = "model.token_position_embeddings.pp_block.token_embedding.weight"
STAR_EMB = "model.token_embeddings.pp_block.token_embedding.weight"
NORM = "model.final_layer_norm.pp_block.weight"
HEAD = "model.lm_head.pp_block.weight"
QKV = ["attn.qkv_proj.weight", "attn.qkv_proj.bias", "attn.o_proj.weight"]
MLP = ["mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
MOE_MLP = ["mlp.router.weight", "mlp.shared_expert.gate_up_proj.weight",
           "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight",
           "mlp.experts.merged_gate_up_proj", "mlp.experts.merged_down_proj"]  # fmt: skip
MQA = ["attn.qkv.q.bias", "attn.qkv.q.weight", "attn.qkv.kv.bias", "attn.qkv.kv.weight",
       "attn.o.weight", "attn.o.bias"]  # fmt: skip
GQA = ["attn.query_key_value.weight", "attn.query_key_value.bias", "attn.dense.weight",
       "attn.dense.bias"]  # fmt: skip
STAR_MLP = ["ff.c_fc.weight", "ff.c_fc.bias", "ff.c_proj.weight", "ff.c_proj.bias"]
ROW_BIASES = ("attn.o.bias", "attn.dense.bias", "ff.c_proj.bias")  # tp rank 0 only
MC = "model.model_config"
FAMILIES = {  # name: (base config, overrides)
    "llama": (TINY, []),
    "qwen2": (QWEN, []),
    "qwen2-moe": (MOE, []),
    "starcoder2": (STAR, []),  # multi-query: Nanotron's default
    "starcoder2-gqa": (STAR, [f"{MC}.grouped_query=true", f"{MC}.num_kv_heads=2"]),
}
ONE_STEP = ["tokens.train_steps=1", "checkpoints.checkpoint_interval=1"]
LAYOUTS = {  # dp, tp, tp mode, zero
    "tp1": (1, 1, "ALL_REDUCE", 0),
    "tp2": (1, 2, "ALL_REDUCE", 0),
    "tp2 rs": (1, 2, "REDUCE_SCATTER", 0),
    "dp2 zero1": (2, 1, "ALL_REDUCE", 1),
}


def _layer_order(mc, i: int) -> list[str]:
    """Nanotron's `named_parameters()` order of decoder layer `i` (every tp rank's)."""
    if hasattr(mc, "grouped_query"):  # Starcoder2
        attn = GQA if mc.grouped_query else MQA
        ln = ["weight", "bias"]
        return [f"ln_1.{n}" for n in ln] + attn + [f"ln_2.{n}" for n in ln] + STAR_MLP
    if hasattr(mc, "moe_config"):  # Qwen2
        moe = set(mc.moe_config.layers) if mc.moe_config else set()
        attn = QKV if mc.attention_bias else [n for n in QKV if not n.endswith("bias")]
        norms = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        return norms + attn + (MOE_MLP if i in moe else MLP)
    attn = [n for n in QKV if not n.endswith("bias")]
    return ["input_layernorm.weight", *attn, "post_attention_layernorm.weight", *MLP]


def nanotron_order(cfg, tp_rank: int = 0) -> list[str]:
    """Nanotron's `named_parameters()` order on tp rank `tp_rank` (one pipeline stage)."""
    mc = cfg.model.model_config
    star = hasattr(mc, "grouped_query")
    out = [STAR_EMB if star else LLAMA_EMB]
    for i in range(mc.num_hidden_layers):
        layer = _layer_order(mc, i)
        if tp_rank > 0:
            layer = [n for n in layer if n not in ROW_BIASES]
        out += [f"model.decoder.{i}.pp_block.{n}" for n in layer]
    out.append(NORM)
    if star:
        out.append(NORM.replace(".weight", ".bias"))
    return out + ([] if star or mc.tie_word_embeddings else [HEAD])


def family_config(family: str, layout: str):
    base, extra = FAMILIES[family]
    dp, tp, mode, zero = LAYOUTS[layout]
    return apply_overrides(
        config_from_dict(base), extra + layout_overrides(dp, tp, mode, zero, None)
    )


def _save(world: int, family: str, layouts: list[str], root) -> None:
    base, extra = FAMILIES[family]
    runs = []
    for name in layouts:
        dp, tp, mode, zero = LAYOUTS[name]
        path = root / name.replace(" ", "_")
        runs.append(extra + layout_overrides(dp, tp, mode, zero, None) + ONE_STEP
                    + [f"checkpoints.checkpoints_path={path}"])  # fmt: skip
    run_ranks(world, train_runs, runs, base, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("order")
    out = {}
    for family in FAMILIES:
        _save(1, family, ["tp1"], root / family)
        _save(2, family, ["tp2", "tp2 rs", "dp2 zero1"], root / family)
        out[family] = root / family
    return out


def check_pairing(step, cfg, dp: int, tp: int, zero: bool) -> tuple[int, list[str]]:
    """Pair every optimizer file's states (and LR scheduler file's lists) with Nanotron's
    parameters of that tp rank by position, as its loader does; (state tensors checked,
    mismatches as 'file: index name: state shape != param shape')."""
    params = {p.name: p for p in nanotron_params(model_shape(cfg))}
    assert set(params) == set(nanotron_order(cfg))  # the test's table names what mesh3d writes
    config = json.loads((step / "optimizer" / "optimizer_config.json").read_text())
    offsets = config["configs"].get("param_name_to_dp_rank_offsets", {})
    checked, bad = 0, []
    for t in range(tp):
        order = nanotron_order(cfg, t)
        sched = f"lr_scheduler_pp-0-of-1_tp-{t}-of-{tp}_exp-0-of-1.pt"
        lrs = torch.load(step / "lr_scheduler" / sched)
        if len(lrs["base_lrs"]) != len(order):
            bad.append(f"{sched}: {len(lrs['base_lrs'])} entries, Nanotron has {len(order)}")
        for d in range(dp):
            part = f"_dp-{d}-of-{dp}" if zero else ""
            file = f"optimizer_pp-0-of-1{part}_tp-{t}-of-{tp}_exp-0-of-1.pt"
            opt = torch.load(step / "optimizer" / file)
            names = list(opt["names"].values())
            if sorted(names) != sorted(order):  # Nanotron's only name check
                extra, missing = sorted(set(names) - set(order)), sorted(set(order) - set(names))
                bad.append(f"{file}: names differ: extra {extra}, missing {missing}")
                continue
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
@pytest.mark.parametrize("family", list(FAMILIES))
def test_optimizer_states_pair_with_nanotron_parameters_by_position(saved, family, layout):
    dp, tp, _, zero = LAYOUTS[layout]
    step = saved[family] / layout.replace(" ", "_") / "1"
    checked, bad = check_pairing(step, family_config(family, layout), dp, tp, bool(zero))
    print(f"\n{family} {layout}: {checked} state tensors paired by position, {len(bad)} mismatched")
    assert checked > 0 and bad == [], bad[:5]
