"""Qwen2's spec (the model is `models/qwen2.py`): Llama's, plus the q/k/v bias, and two HF
architectures.

Nanotron: the same parameter names as Llama, plus `attn.qkv_proj.bias` when `attention_bias`
(q, k, v biases concatenated like the weights, split over TP in the same chunks). Hugging Face:
`Qwen2ForCausalLM` (always has q/k/v biases: zeros when `attention_bias` is false; a sliding
window on all layers), `SmolLM3ForCausalLM` for a model with NoPE layers (`no_rope_layer`), or
`Qwen2MoeForCausalLM` for one with a `moe_config` (the MoE layers are HF's sparse ones, the others
its `mlp_only_layers`; it always has a shared expert and q/k/v biases). What none can express
one-to-one is refused with the reason (e.g. a window with NoPE layers: Nanotron slides the RoPE
layers, SmolLM3 the NoPE ones; or renormalized top-k router weights, `norm_topk_prob`).

Qwen2-MoE's experts: ours are `merged_gate_up_proj` [E, h, 2F] and `merged_down_proj` [E, F, h],
applied as x @ W; transformers 5 holds `experts.gate_up_proj` [E, 2F, h] and `experts.down_proj`
[E, h, F] in memory (applied as x @ Wᵀ, the same gate-then-up order), and writes (and the Hub
holds, and transformers 4 reads) one `experts.{e}.{gate,up,down}_proj.weight` per expert. The
name maps go to the in-memory names; `moe_spec.experts_to_hf` writes the per-expert form, and
`moe_spec.moe_weights_from_hf` reads either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from mesh3d.config.other_families import Qwen2Config
from mesh3d.models import llama_spec, moe_spec
from mesh3d.models.llama_checks import MC, llama_errors
from mesh3d.models.spec import HFSpec, LayerTable, ModelShape


def qwen2_errors(cfg) -> Iterator[str]:
    """Llama's, plus Qwen2's NoPE layers, sliding window and RoPE interpolation."""
    yield from llama_errors(cfg)
    yield from _qwen2_fields(cfg.model.model_config)


def _qwen2_fields(mc) -> Iterator[str]:
    k, layers = mc.no_rope_layer, mc.num_hidden_layers
    if k is not None and (k < 1 or layers % k):
        yield (
            f"`{MC}.no_rope_layer` ({k}) must be >= 1 and divide num_hidden_layers ({layers}) "
            "(every k-th layer has no RoPE, the last one included); use a divisor or null"
        )
    if mc.sliding_window_size is not None and mc.sliding_window_size < 1:
        yield f"`{MC}.sliding_window_size` must be >= 1 or null, got {mc.sliding_window_size}"
    factor = mc.rope_seq_len_interpolation_factor
    if factor is not None and not factor > 0:
        yield f"`{MC}.rope_seq_len_interpolation_factor` must be > 0 or null, got {factor}"


BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def shape(mc, padded_vocab: int) -> ModelShape:
    from mesh3d.models.moe import moe_layers

    base = llama_spec.shape(mc, padded_vocab)
    moe = mc.moe_config
    experts = {}
    if moe is not None:
        experts = dict(
            moe_layers=tuple(moe_layers(mc)), num_experts=moe.num_experts, top_k=moe.top_k,
            moe_ffn=moe.moe_intermediate_size,
            shared_ffn=moe.shared_expert_intermediate_size if moe.enable_shared_expert else 0,
        )  # fmt: skip
    return dataclasses.replace(base, family="qwen2", qkv_bias=bool(mc.attention_bias), **experts)


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.qwen2 import Qwen2

    return Qwen2(mc, vocab_size=vocab_size, attention=attention)


def step_flops(s: ModelShape, seq_len: int, batch_size: int) -> float:
    """Llama's model FLOPs with each MoE layer's MLP counted as what a token runs: the router,
    its top-k experts and the shared expert (and its gate), not the dense MLP."""
    flops = llama_spec.step_flops(s, seq_len, batch_size)
    if not s.moe_layers:
        return flops
    tokens, h = batch_size * seq_len, s.hidden_size
    dense = 6 * tokens * h * s.intermediate_size  # gate, up, down: 2·h·F each per token
    routed = 6 * tokens * h * (s.top_k * s.moe_ffn + s.shared_ffn)
    routed += 2 * tokens * h * (s.num_experts + (1 if s.shared_ffn else 0))  # router, shared gate
    return flops + 3.0 * len(s.moe_layers) * (routed - dense)


def tp_plan(sequence_parallel: bool, shape: ModelShape | None = None) -> dict:
    """Llama's plan; with `shape`'s MoE layers, their MLP entries replaced by the experts'
    style (replicated weights, the rank's tokens: `tp_family_styles.py::ExpertsReplicated`)."""
    plan = llama_spec.tp_plan(sequence_parallel)
    if shape is None or not shape.moe_layers:
        return plan
    from mesh3d.tp_family_styles import ExpertsReplicated

    mlp = {k: plan.pop(k) for k in list(plan) if k.startswith("layers.*.mlp")}
    for i in range(shape.num_layers):
        if i in shape.moe_layers:
            plan[f"layers.{i}.mlp"] = ExpertsReplicated(sequence_parallel)
        else:
            plan.update({k.replace("layers.*", f"layers.{i}"): v for k, v in mlp.items()})
    return plan


# Nanotron's order of a Qwen2 decoder layer's parameters (`models/qwen.py`, `nn/moe.py`: the
# order `named_parameters()` yields them, which its optimizer files follow and its loader pairs by
# position). `Qwen2DecoderLayer` registers `post_attention_layernorm` before `attn` (both norms
# are assigned first); `Qwen2MoELayer` registers the router, the shared expert, its gate, then the
# experts. Llama's layer differs (attn before post_attention_layernorm): `llama_spec`.
NANOTRON_ORDER = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "attn.qkv_proj.weight",
    "attn.qkv_proj.bias",
    "attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.router.weight",
    "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight",
    "mlp.experts.merged_gate_up_proj",
    "mlp.experts.merged_down_proj",
)


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    """Llama's parameters plus `attn.qkv_proj.bias` when `qkv_bias`; in an MoE layer the experts
    replace the MLP. In `NANOTRON_ORDER`, Nanotron's (not Llama's) module order."""
    out: LayerTable = {}
    for key, value in llama_spec.NANOTRON_LAYER.items():
        if key.startswith("mlp.") and i in s.moe_layers:
            continue
        out[key] = value
    if s.qkv_bias:
        out["attn.qkv_proj.bias"] = (BIAS, "column")
    if i in s.moe_layers:
        out.update(moe_spec.MOE_LAYER)
        if s.shared_ffn:
            out.update(moe_spec.SHARED_EXPERT)
    return {key: out[key] for key in sorted(out, key=NANOTRON_ORDER.index)}


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    shapes = llama_spec.param_shapes(s)
    h, e, f = s.hidden_size, s.num_experts, s.moe_ffn
    for i in s.moe_layers:
        for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            del shapes[f"layers.{i}.mlp.{name}"]
        shapes[f"layers.{i}.mlp.gate.weight"] = (e, h)
        shapes[f"layers.{i}.mlp.experts.merged_gate_up_proj"] = (e, h, 2 * f)
        shapes[f"layers.{i}.mlp.experts.merged_down_proj"] = (e, f, h)
        if s.shared_ffn:
            g = s.shared_ffn
            shapes[f"layers.{i}.mlp.shared_expert.gate_proj.weight"] = (g, h)
            shapes[f"layers.{i}.mlp.shared_expert.up_proj.weight"] = (g, h)
            shapes[f"layers.{i}.mlp.shared_expert.down_proj.weight"] = (h, g)
            shapes[f"layers.{i}.mlp.shared_expert_gate.weight"] = (1, h)
    if s.qkv_bias:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i in range(s.num_layers):
            for name, size in zip(BIAS, (q, kv, kv)):
                shapes[f"layers.{i}.{name}"] = (size,)
    return shapes


# ------------------------------------------------------------------------- Hugging Face


def _common(hf: dict, where) -> dict:
    """The shared fields, with HF's linear rope scaling as Nanotron's interpolation factor."""
    from mesh3d.models.hf_fields import common_fields

    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    factor = None
    if params.get("rope_type", params.get("type")) == "linear":
        factor = float(params["factor"])
        hf = {
            **hf,
            "rope_parameters": {
                "rope_theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))
            },
        }
        hf.pop("rope_scaling", None)
    fields = common_fields(hf, where)
    if fields["rope_scaling"] is not None:
        from mesh3d.models.hf_fields import refuse

        refuse(where, "rope scaling other than linear for Qwen2 (Nanotron's Qwen2 has none)")
    return {**fields, "rope_seq_len_interpolation_factor": factor}


def _window_from_hf(hf: dict, where) -> int | None:
    """Nanotron's one window for all (RoPE) layers, from HF's per-layer sliding settings."""
    from mesh3d.models.hf_fields import refuse

    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not hf.get("use_sliding_window") or not hf.get("sliding_window"):
        if types and "sliding_attention" in types:
            refuse(where, "layer_types with sliding layers but use_sliding_window false")
        return None
    first = hf.get("max_window_layers", 0) or 0
    sliding = (
        [t == "sliding_attention" for t in types] if types else [i >= first for i in range(layers)]
    )
    if all(sliding):
        return int(hf["sliding_window"])
    if not any(sliding):
        return None
    refuse(where, "a sliding window on some layers only (Nanotron's Qwen2 slides every layer)")


def _rope_hf(mc) -> dict:
    factor = mc.rope_seq_len_interpolation_factor
    if not factor:
        return {}
    params = {"rope_type": "linear", "factor": factor, "rope_theta": mc.rope_theta}
    return {"rope_parameters": params, "rope_scaling": {"rope_type": "linear", "factor": factor}}


def qwen2_from_hf(hf: dict, where) -> Qwen2Config:
    fields = _common(hf, where)
    return Qwen2Config(
        **fields, attention_bias=True, sliding_window_size=_window_from_hf(hf, where)
    )


def qwen2_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import common_hf, refuse

    if mc.no_rope_layer:
        refuse("Qwen2ForCausalLM", "no_rope_layer (converted as SmolLM3ForCausalLM instead)")
    window = mc.sliding_window_size
    n = mc.num_hidden_layers
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **common_hf(mc, dtype),
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else n,
        "layer_types": ["sliding_attention" if window else "full_attention"] * n,
        **_rope_hf(mc),
    }


def zero_biases(weights: dict, mc) -> dict:
    """HF Qwen2 always has q/k/v biases: zeros for a model trained without them."""
    if mc.attention_bias:
        return weights
    out = dict(weights)
    for i in range(mc.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = weights[f"model.layers.{i}.self_attn.{proj}.weight"]
            out[f"model.layers.{i}.self_attn.{proj}.bias"] = w.new_zeros(w.shape[0])
    return out


def smollm3_from_hf(hf: dict, where) -> Qwen2Config:
    from mesh3d.models.hf_fields import refuse

    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(where, f"SmolLM3 `{key}: true` (it puts a bias on o_proj / the MLP)")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        refuse(where, "SmolLM3's sliding window (on NoPE layers; Nanotron's is on RoPE layers)")
    n = hf["num_hidden_layers"]
    uses = hf.get("no_rope_layers")
    k = hf.get("no_rope_layer_interval", 4)
    if uses is None:
        uses = [int((i + 1) % k != 0) for i in range(n)]
    nope = [i for i, u in enumerate(uses) if not u]
    k = nope[0] + 1 if nope else None
    if nope and ([int((i + 1) % k != 0) for i in range(n)] != list(uses) or n % k):
        refuse(where, f"no_rope_layers {uses}: Nanotron's no_rope_layer is every k-th layer")
    fields = _common(hf, where)
    return Qwen2Config(**fields, attention_bias=False, no_rope_layer=k)


def smollm3_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import common_hf, refuse

    if mc.attention_bias:
        refuse(
            "SmolLM3ForCausalLM", "attention_bias with NoPE layers (SmolLM3's bias covers o_proj)"
        )
    if mc.sliding_window_size is not None:
        refuse("SmolLM3ForCausalLM", "a sliding window with NoPE layers")
    n, k = mc.num_hidden_layers, mc.no_rope_layer
    return {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        **common_hf(mc, dtype),
        "attention_bias": False,
        "mlp_bias": False,
        "no_rope_layer_interval": k,
        "no_rope_layers": [int((i + 1) % k != 0) for i in range(n)],
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * n,
        **_rope_hf(mc),
    }


MOE_HF = "Qwen2MoeForCausalLM"


def qwen2_moe_from_hf(hf: dict, where) -> Qwen2Config:
    """A Qwen2 config with a `moe_config` (`moe_spec.moe_from_hf`)."""
    from mesh3d.models.hf_fields import refuse

    if hf.get("norm_topk_prob"):
        refuse(where, "`norm_topk_prob: true` (Nanotron's Qwen2 MoE does not renormalize the "
                      "top-k router weights)")  # fmt: skip
    moe = moe_spec.moe_from_hf(hf, where, shared=True, dense_arch="Qwen2ForCausalLM")
    n = hf["num_hidden_layers"]
    if hf.get("use_sliding_window") and not hf.get("layer_types"):
        types = [  # transformers 5's default for Qwen2-MoE: every other layer below the limit
            "sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", 28) else
            "full_attention" for i in range(n)
        ]  # fmt: skip
        hf = {**hf, "layer_types": types}
    fields = _common(hf, where)
    return Qwen2Config(
        **fields, attention_bias=bool(hf.get("qkv_bias", True)),
        sliding_window_size=_window_from_hf(hf, where), moe_config=moe,
    )  # fmt: skip


def qwen2_moe_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import refuse

    if mc.no_rope_layer:
        refuse(MOE_HF, "no_rope_layer with moe_config (Qwen2-MoE has RoPE on every layer)")
    moe = mc.moe_config
    if not moe.enable_shared_expert:
        refuse(MOE_HF, "`moe_config.enable_shared_expert: false` (HF's Qwen2-MoE always has a "
                       "shared expert)")  # fmt: skip
    return {
        **qwen2_to_hf(mc, dtype),
        "architectures": [MOE_HF],
        "model_type": "qwen2_moe",
        "qkv_bias": True,  # zeros when attention_bias is false (`moe_weights_to_hf`)
        "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        **moe_spec.moe_to_hf(mc),
    }


def moe_weights_to_hf(weights: dict, mc) -> dict:
    """Qwen2-MoE's: zero q/k/v biases if need be, and the experts per expert."""
    return moe_spec.experts_to_hf(zero_biases(weights, mc), mc)


def hf_for(mc) -> HFSpec:
    if mc.moe_config is not None:
        return QWEN2_MOE
    return SMOLLM3 if mc.no_rope_layer else QWEN2_HF


names = (llama_spec.ours_to_hf, llama_spec.hf_to_ours)
QWEN2_HF = HFSpec(("Qwen2ForCausalLM",), "qwen2", qwen2_from_hf, qwen2_to_hf, *names, zero_biases)
SMOLLM3 = HFSpec(("SmolLM3ForCausalLM",), "smollm3", smollm3_from_hf, smollm3_to_hf, *names)
QWEN2_MOE = HFSpec(
    (MOE_HF,), "qwen2_moe", qwen2_moe_from_hf, qwen2_moe_to_hf, moe_spec.moe_ours_to_hf, moe_spec.moe_hf_to_ours,
    moe_weights_to_hf, moe_spec.moe_weights_from_hf,
)  # fmt: skip

QWEN2 = dataclasses.replace(  # Llama's init, FLOPs and pipeline costs; its own weights, TP plan
    llama_spec.LLAMA,
    family="qwen2",
    blocks=moe_spec.blocks_with_moe,
    config_class=Qwen2Config,
    shape=shape,
    build=build,
    tp_plan=tp_plan,
    config_errors=qwen2_errors,
    step_flops=step_flops,
    nanotron_layer=nanotron_layer,
    param_shapes=param_shapes,
    hf=(QWEN2_HF, SMOLLM3, QWEN2_MOE),
    hf_for=hf_for,
)
