"""Qwen3's spec (the model is `models/qwen3.py`): Qwen2's, plus the q/k norms, a free head size
and HF `Qwen3ForCausalLM`, or `Qwen3MoeForCausalLM` for one with a `moe_config` (Qwen2's MoE
layers and names, no shared expert, the top-k router weights renormalized when
`norm_topk_prob`; HF's sparse layers are the MoE ones, the others its `mlp_only_layers`).

Nanotron has no Qwen3, so its names here are mesh3d's extension of Nanotron's layout: the norms
are `attn.q_norm.weight` and `attn.k_norm.weight` in each decoder layer, written once (not
split over tp), like the other norms. Under tensor parallelism a rank holds whole heads, so each
norm runs on its local heads with the full weight; its gradient is summed over tp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from mesh3d.config.other_families import Qwen3Config
from mesh3d.models import llama_spec, moe_spec, qwen2_spec
from mesh3d.models.spec import HFSpec, LayerTable, ModelShape

QK_NORMS = {"attn.q_norm.weight": (("self_attn.q_norm.weight",), "replicated"),
            "attn.k_norm.weight": (("self_attn.k_norm.weight",), "replicated")}  # fmt: skip


def shape(mc, padded_vocab: int) -> ModelShape:
    base = qwen2_spec.shape(mc, padded_vocab)
    head_dim = mc.head_dim or mc.hidden_size // mc.num_attention_heads
    return dataclasses.replace(base, family="qwen3", head_dim=head_dim, qk_norm=True)


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.qwen3 import Qwen3

    return Qwen3(mc, vocab_size=vocab_size, attention=attention)


def tp_plan(sequence_parallel: bool, shape: ModelShape | None = None) -> dict:
    """Qwen2's plan, plus the q/k norms on each rank's heads: the input taken as sharded on its
    head dim (2 of [B, S, heads, dh]), the weight replicated (its gradient then sums over tp)."""
    from mesh3d.tp_styles import LocalReplicated

    plan = qwen2_spec.tp_plan(sequence_parallel, shape)
    for norm in ("q_norm", "k_norm"):
        plan[f"layers.*.self_attn.{norm}"] = LocalReplicated(partial_grads=True)
    return plan


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    """Qwen2's table with the q/k norms right after the q/k/v projection (module order)."""
    out: LayerTable = {}
    last_qkv = "attn.qkv_proj.bias" if s.qkv_bias else "attn.qkv_proj.weight"
    for key, value in qwen2_spec.nanotron_layer(s, i).items():
        out[key] = value
        if key == last_qkv:
            out.update(QK_NORMS)
    return out


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    shapes = qwen2_spec.param_shapes(s)
    for i in range(s.num_layers):
        for norm in ("q_norm", "k_norm"):
            shapes[f"layers.{i}.self_attn.{norm}.weight"] = (s.head_dim,)
    return shapes


# ------------------------------------------------------------------------- Hugging Face


def qwen3_from_hf(hf: dict, where) -> Qwen3Config:
    from mesh3d.models.hf_fields import refuse

    if hf.get("attention_bias"):
        refuse(where, "Qwen3 `attention_bias: true` (its bias covers o_proj)")
    fields = qwen2_spec._common(hf, where)
    window = qwen2_spec._window_from_hf(hf, where)
    return Qwen3Config(**fields, attention_bias=False, sliding_window_size=window,
                       head_dim=hf.get("head_dim"))  # fmt: skip


def qwen3_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import refuse

    if mc.attention_bias:
        refuse("Qwen3ForCausalLM", "attention_bias (HF's Qwen3 bias covers o_proj too)")
    out = qwen2_spec.qwen2_to_hf(mc, dtype)
    out.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
               head_dim=mc.head_dim or mc.hidden_size // mc.num_attention_heads)  # fmt: skip
    return out


MOE_HF = "Qwen3MoeForCausalLM"


def qwen3_moe_from_hf(hf: dict, where) -> Qwen3Config:
    """A Qwen3 config with a `moe_config` (no shared expert) and HF's `norm_topk_prob`."""
    moe = moe_spec.moe_from_hf(hf, where, shared=False, dense_arch="Qwen3ForCausalLM")
    # HF's Qwen3-MoE slides every layer or none: it has no layer_types nor max_window_layers
    every_layer = {**hf, "layer_types": None, "max_window_layers": 0}
    return dataclasses.replace(qwen3_from_hf(every_layer, where), moe_config=moe,
                               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))  # fmt: skip


def qwen3_moe_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import refuse

    if mc.moe_config.enable_shared_expert:
        refuse(MOE_HF, "`moe_config.enable_shared_expert: true` (HF's Qwen3-MoE has no shared "
                       "expert)")  # fmt: skip
    out = qwen3_to_hf(mc, dtype)
    del out["layer_types"], out["max_window_layers"]  # not Qwen3-MoE's: one window for all
    out.update(architectures=[MOE_HF], model_type="qwen3_moe", **moe_spec.moe_to_hf(mc))
    return out


def config_errors(cfg) -> Iterator[str]:
    """Qwen2's checks, and renormalized router weights only with experts (Qwen3-MoE)."""
    yield from qwen2_spec.qwen2_errors(cfg)
    mc = cfg.model.model_config
    if mc.norm_topk_prob and mc.moe_config is None:
        yield ("`mesh3d.norm_topk_prob` is only for `mesh3d.model_family: qwen3` with a "
               "`model.model_config.moe_config` (Qwen3-MoE); remove it or set both")  # fmt: skip


def hf_for(mc) -> HFSpec:
    return QWEN3_MOE_HF if mc.moe_config is not None else QWEN3_HF


QWEN3_HF = HFSpec(("Qwen3ForCausalLM",), "qwen3", qwen3_from_hf, qwen3_to_hf,
                  llama_spec.ours_to_hf, llama_spec.hf_to_ours)  # fmt: skip
# the experts as Qwen2-MoE's (names, per-expert files); no q/k/v biases
QWEN3_MOE_HF = HFSpec(
    (MOE_HF,), "qwen3_moe", qwen3_moe_from_hf, qwen3_moe_to_hf, moe_spec.moe_ours_to_hf,
    moe_spec.moe_hf_to_ours, moe_spec.experts_to_hf, moe_spec.moe_weights_from_hf,
)  # fmt: skip

QWEN3 = dataclasses.replace(  # Llama's init and pipeline costs; q/k norms in TP and weights
    llama_spec.LLAMA,
    family="qwen3",
    blocks=moe_spec.blocks_with_moe,
    config_class=Qwen3Config,
    shape=shape,
    build=build,
    tp_plan=tp_plan,
    config_errors=config_errors,
    step_flops=qwen2_spec.step_flops,  # Llama's, with MoE layers as what a token runs
    nanotron_layer=nanotron_layer,
    param_shapes=param_shapes,
    hf=(QWEN3_HF, QWEN3_MOE_HF),
    hf_for=hf_for,
)
