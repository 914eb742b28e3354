"""Starcoder2's spec (the model is `models/starcoder2.py`): Nanotron's names, the TP plan, the
config checks, Nanotron's init, costs and FLOPs, and HF `Starcoder2ForCausalLM` both ways.

Nanotron (`src/nanotron/models/starcoder2.py`): decoder layer `i` holds `ln_1`, `attn`, `ln_2`,
`ff` (`c_fc`, `c_proj`), every linear and norm with a bias. Multi-query attention is
`attn.qkv.q` (split over tp) and `attn.qkv.kv` (one head, written once: every tp rank holds it
whole) and `attn.o`; grouped-query attention is `attn.query_key_value` (our `qkv_proj`, the same
layout) and `attn.dense`. The embedding is `model.token_embeddings...` (not Llama's
`token_position_embeddings`), tied to the head (never written apart), and the final norm has a
bias. A row-parallel linear's bias is written once (not split), and Nanotron creates it on tp
rank 0 only, so the optimizer files of the other tp ranks leave it out
(`checkpoint/nanotron_state.py::tp_rank_entries`).

Hugging Face `Starcoder2ForCausalLM` holds q/k/v apart (`num_key_value_heads` 1 for multi-query)
and slides the window on every layer; what it cannot express (`global_attn_layers` with a
window, no RoPE) is refused, and so are HF models Nanotron cannot hold (no biases, untied
embeddings, RoPE scaling). Dropout: HF's `attention_dropout` is Nanotron's `attn_pdrop`,
`residual_dropout` its `resid_pdrop`, `embedding_dropout` its `embd_pdrop` (Nanotron also drops
the attention branch with `attn_pdrop`, where HF uses `residual_dropout`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.derive import longest_sequence
from mesh3d.config.other_families import Starcoder2Config
from mesh3d.errors import not_divisible
from mesh3d.models import llama_spec
from mesh3d.models.activations import HIDDEN_ACTS
from mesh3d.models.llama_checks import ATTN_IMPLEMENTATIONS, MC
from mesh3d.models.spec import Blocks, HFSpec, LayerTable, ModelShape, ModelSpec
from mesh3d.nanotron_names import FINAL_NORM, LM_HEAD


def _pairs(nanotron: str, ours: str, weight: str, bias: str = "replicated") -> LayerTable:
    """A linear or norm's weight and bias rows: Nanotron name prefix, ours, their TP kinds."""
    return {f"{nanotron}.weight": ((f"{ours}.weight",), weight),
            f"{nanotron}.bias": ((f"{ours}.bias",), bias)}  # fmt: skip


def _bias_first(table: LayerTable) -> LayerTable:
    """`table` with each bias before its weight: Nanotron's `MQAColumnLinears` keeps q and kv in
    `nn.ParameterDict`s built from plain dicts, which torch orders by key."""
    return dict(sorted(table.items()))


MQA_ATTENTION = {
    **_bias_first(_pairs("attn.qkv.q", "self_attn.q_proj", "column", "column")),
    **_bias_first(_pairs("attn.qkv.kv", "self_attn.kv_proj", "replicated")),
    **_pairs("attn.o", "self_attn.o_proj", "row"),
}
GQA_ATTENTION = {
    **_pairs("attn.query_key_value", "self_attn.qkv_proj", "column", "column"),
    **_pairs("attn.dense", "self_attn.o_proj", "row"),
}
EMBEDDING = "model.token_embeddings.pp_block.token_embedding.weight"
NANOTRON_OUTER = {
    EMBEDDING: (("embed_tokens.weight",), "vocab", "first"),
    FINAL_NORM: (("norm.weight",), "replicated", "last"),
    FINAL_NORM.replace(".weight", ".bias"): (("norm.bias",), "replicated", "last"),
    LM_HEAD: (("lm_head.weight",), "vocab", "last"),  # tied: never written
}


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    """Layer `i`'s parameters in Nanotron's module order (ln_1, attn, ln_2, ff)."""
    return {
        **_pairs("ln_1", "input_layernorm", "replicated"),
        **(MQA_ATTENTION if s.multi_query else GQA_ATTENTION),
        **_pairs("ln_2", "post_attention_layernorm", "replicated"),
        **_pairs("ff.c_fc", "mlp.c_fc", "column", "column"),
        **_pairs("ff.c_proj", "mlp.c_proj", "row"),
    }


def is_multi_query(mc) -> bool:
    """Multi-query attention: set, or neither kind set (Nanotron's `__post_init__` then sets
    it); grouped-query attention with `grouped_query`."""
    return not mc.grouped_query


def ffn_size(mc) -> int:
    """Nanotron's d_ff: `intermediate_size`, or 4 · hidden_size when null."""
    return mc.intermediate_size or 4 * mc.hidden_size


def shape(mc, padded_vocab: int) -> ModelShape:
    multi = is_multi_query(mc)
    return ModelShape(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        intermediate_size=ffn_size(mc),
        num_heads=mc.num_attention_heads,
        num_kv_heads=1 if multi else mc.num_kv_heads,
        padded_vocab=padded_vocab,
        tied=True,
        family="starcoder2",
        qkv_bias=True,
        multi_query=multi,
    )


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.starcoder2 import Starcoder2

    return Starcoder2(mc, vocab_size=vocab_size, attention=attention)


def tp_plan(sequence_parallel: bool, shape: ModelShape | None = None) -> dict:
    """Llama's plan with Starcoder2's modules: q (multi-query) or the fused qkv (grouped-query,
    whole key/value groups per rank) and c_fc column-wise, o and c_proj row-wise (their biases
    replicated), the multi-query key/value head whole on every rank (its gradient summed over
    tp), LayerNorms like RMSNorms, and each dropout told its tp rank (the offset of its heads,
    or of its sequence shard under sequence parallelism)."""
    from mesh3d.tp_family_styles import RankAware
    from mesh3d.tp_styles import LocalReplicated

    plan = llama_spec.tp_plan(sequence_parallel)
    layer = "layers.*.{}".format
    for name in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        del plan[layer(name)]
    plan[layer("self_attn.qkv_proj")] = plan[layer("self_attn.q_proj")]
    plan[layer("self_attn.kv_proj")] = LocalReplicated(partial_grads=True)
    plan[layer("mlp.c_fc")] = plan.pop(layer("mlp.gate_proj"))
    plan[layer("mlp.c_proj")] = plan.pop(layer("mlp.down_proj"))
    for name in ("embed_dropout", layer("attn_dropout"), layer("mlp_dropout"),
                 layer("self_attn.probs_dropout")):  # fmt: skip
        plan[name] = RankAware()
    return plan


def compile_classes(tensor_parallel: bool) -> tuple[type, ...]:
    """Attention, MLP and the dropouts, and the LayerNorms without tp."""
    from mesh3d.models.dropout import KeyedDropout
    from mesh3d.models.starcoder2 import LayerNorm, Starcoder2Attention, Starcoder2MLP

    blocks = (Starcoder2Attention, Starcoder2MLP, KeyedDropout)
    return blocks if tensor_parallel else (*blocks, LayerNorm)


def blocks() -> Blocks:
    """The attention modules (context parallelism); no mixture of experts."""
    from mesh3d.models.starcoder2 import Starcoder2Attention

    return Blocks(attention=(Starcoder2Attention,))


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    h, f, dh = s.hidden_size, s.intermediate_size, s.head_dim
    q = s.num_heads * dh
    layer = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,)}
    if s.multi_query:
        layer.update({"self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
                      "self_attn.kv_proj.weight": (2 * dh, h), "self_attn.kv_proj.bias": (2 * dh,)})  # fmt: skip
    else:
        qkv = q + 2 * s.num_kv_heads * dh
        layer.update({"self_attn.qkv_proj.weight": (qkv, h), "self_attn.qkv_proj.bias": (qkv,)})
    layer.update({
        "self_attn.o_proj.weight": (h, q), "self_attn.o_proj.bias": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
        "mlp.c_fc.weight": (f, h), "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (h, f), "mlp.c_proj.bias": (h,),
    })  # fmt: skip
    shapes = {"embed_tokens.weight": (s.padded_vocab, h), "norm.weight": (h,), "norm.bias": (h,),
              "lm_head.weight": (s.padded_vocab, h)}  # fmt: skip
    for i in range(s.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def init_std(name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"):
    """Nanotron's Starcoder2 init (`init_model_randomly`): norm weights ones, every bias zero,
    the row-parallel o and c_proj N(0, std / sqrt(2 · layers)) whatever `scaling_method` says
    (Nanotron's Starcoder2 does not read it), everything else N(0, std)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(("o_proj.weight", "c_proj.weight")):
        return std / math.sqrt(2 * num_layers)
    return std


def step_flops(s: ModelShape, seq_len: int, batch_size: int) -> float:
    """Llama's model FLOPs with a two-matrix MLP (c_fc, c_proj) instead of the gated three."""
    gate = 2 * s.num_layers * batch_size * seq_len * s.hidden_size * s.intermediate_size
    return llama_spec.step_flops(s, seq_len, batch_size) - 3.0 * gate


def pipeline_costs(s: ModelShape) -> tuple[list[int], int]:
    """Nanotron's `get_block_compute_costs`: 4·nq·dh·h + 2·d_ff·h per layer, V·h for the head."""
    h = s.hidden_size
    cost = 4 * s.num_heads * s.head_dim * h + 2 * s.intermediate_size * h
    return [cost] * s.num_layers, s.padded_vocab * h


def config_sizes(mc) -> dict[str, int]:
    keys = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
            "max_position_embeddings")  # fmt: skip
    sizes = {f"{MC}.{k}": getattr(mc, k) for k in keys}
    if mc.intermediate_size is not None:
        sizes[f"{MC}.intermediate_size"] = mc.intermediate_size
    if mc.grouped_query and mc.num_kv_heads is not None:
        sizes[f"{MC}.num_kv_heads"] = mc.num_kv_heads
    return sizes


def config_errors(cfg) -> Iterator[str]:
    """Attention kind, heads and MLP against tp, layers, window, norms, dropouts, positions."""
    mc, tp = cfg.model.model_config, cfg.parallelism.tp
    tp_fix = "choose a parallelism.tp that divides it"
    if mc.multi_query and mc.grouped_query:
        yield (f"`{MC}.multi_query` and `{MC}.grouped_query` are both true; set one of them "
               "(multi_query: one key/value head for all query heads; grouped_query: "
               "num_kv_heads of them)")  # fmt: skip
    elif mc.grouped_query and mc.num_kv_heads is None:
        yield f"`{MC}.grouped_query` needs `{MC}.num_kv_heads` (the number of key/value heads)"
    elif mc.grouped_query:
        yield from not_divisible(f"{MC}.num_attention_heads", mc.num_attention_heads,
                                 f"{MC}.num_kv_heads", mc.num_kv_heads,
                                 "each key/value head serves a whole group of query heads")  # fmt: skip
        yield from not_divisible(f"{MC}.num_kv_heads", mc.num_kv_heads, "parallelism.tp", tp,
                                 tp_fix + " (each tp rank holds whole key/value groups)")  # fmt: skip
    yield from not_divisible(f"{MC}.num_attention_heads", mc.num_attention_heads,
                             "parallelism.tp", tp, tp_fix)  # fmt: skip
    yield from not_divisible(f"{MC}.intermediate_size", ffn_size(mc), "parallelism.tp", tp, tp_fix)
    heads = mc.num_attention_heads
    yield from not_divisible(f"{MC}.hidden_size", mc.hidden_size, f"{MC}.num_attention_heads",
                             heads, "the head dimension is hidden_size / num_attention_heads")  # fmt: skip
    layers = mc.num_hidden_layers
    outside = [i for i in mc.global_attn_layers if not 0 <= i < layers]
    if outside:
        yield (f"`{MC}.global_attn_layers` has {outside}, outside the layers 0..{layers - 1}; "
               f"use indices below num_hidden_layers ({layers})")  # fmt: skip
    if mc.sliding_window_size is not None and mc.sliding_window_size < 1:
        yield f"`{MC}.sliding_window_size` must be >= 1 or null, got {mc.sliding_window_size}"
    for key in ("attn_pdrop", "embd_pdrop", "resid_pdrop"):
        if not 0 <= getattr(mc, key) < 1:
            yield f"`{MC}.{key}` must be in [0, 1) (a dropout probability), got {getattr(mc, key)}"
    if not mc.layer_norm_epsilon > 0:
        yield f"`{MC}.layer_norm_epsilon` must be > 0, got {mc.layer_norm_epsilon}"
    if mc.activation_function not in HIDDEN_ACTS:
        yield f"`{MC}.activation_function` {mc.activation_function!r} is not supported; use one of {', '.join(HIDDEN_ACTS)}"
    if not mc.scale_attn_weights:
        yield f"`{MC}.scale_attn_weights` must be true (Nanotron's Starcoder2 scales by 1/sqrt(head dim) only)"
    if mc._attn_implementation is not None and mc._attn_implementation not in ATTN_IMPLEMENTATIONS:
        yield f"`{MC}._attn_implementation` {mc._attn_implementation!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} (mesh3d picks attention from mesh3d.attention)"
    yield from _positions(cfg, mc)


def _positions(cfg, mc) -> Iterator[str]:
    if mc.use_rotary_embeddings:
        theta = mc.rope_theta
        if theta is None or not (math.isfinite(theta) and theta > 0):
            yield f"`{MC}.rope_theta` must be a finite number > 0 with use_rotary_embeddings, got {theta}"
        dh = mc.hidden_size // mc.num_attention_heads
        if mc.hidden_size % mc.num_attention_heads == 0 and dh % 2:
            yield f"the head dimension {MC}.hidden_size / num_attention_heads = {dh} must be even for rotary embeddings"
    key, seq = longest_sequence(cfg)
    if mc.max_position_embeddings < seq:
        yield (f"`{MC}.max_position_embeddings` ({mc.max_position_embeddings}) is smaller than "
               f"`{key}` ({seq}); raise it to at least {seq} or lower "
               "sequence_length")  # fmt: skip


def has_dropout(mc) -> bool:
    return max(mc.attn_pdrop, mc.embd_pdrop, mc.resid_pdrop) > 0


# ------------------------------------------------------------------------- Hugging Face

HF = "Starcoder2ForCausalLM"


def config_from_hf(hf: dict, where) -> Starcoder2Config:
    from mesh3d.models.hf_fields import REQUIRED, check_head_dim, hf_rope, refuse

    missing = [k for k in (*REQUIRED, "vocab_size") if k not in hf]
    if missing:
        refuse(where, f"a config.json without {missing}")
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in HIDDEN_ACTS:
        refuse(where, f"hidden_act {act!r} (use one of {', '.join(HIDDEN_ACTS)})")
    if not hf.get("use_bias", True):
        refuse(where, "`use_bias: false` (Nanotron's Starcoder2 has a bias on every linear)")
    if not hf.get("tie_word_embeddings", True):
        refuse(where, "`tie_word_embeddings: false` (Nanotron's Starcoder2 always ties them)")
    theta, scaling = hf_rope(hf)
    if scaling:
        refuse(where, "rope scaling (Nanotron's Starcoder2 has plain RoPE)")
    h, nq = hf["hidden_size"], hf["num_attention_heads"]
    check_head_dim(hf, where, "Starcoder2")
    nkv = hf.get("num_key_value_heads") or nq
    eos = hf.get("eos_token_id", 0)
    return Starcoder2Config(
        activation_function=act, attn_pdrop=float(hf.get("attention_dropout", 0.0)),
        bos_token_id=hf.get("bos_token_id", 0), embd_pdrop=float(hf.get("embedding_dropout", 0.0)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, global_attn_layers=[],
        grouped_query=nkv != 1, hidden_size=h, initializer_range=hf.get("initializer_range", 0.02),
        intermediate_size=hf["intermediate_size"], layer_norm_epsilon=hf.get("norm_epsilon", 1e-5),
        max_position_embeddings=hf.get("max_position_embeddings", 4096), multi_query=nkv == 1,
        num_attention_heads=nq, num_hidden_layers=hf["num_hidden_layers"],
        num_kv_heads=None if nkv == 1 else nkv, resid_pdrop=float(hf.get("residual_dropout", 0.0)),
        rope_theta=int(theta) if theta.is_integer() else theta,  # Nanotron's is an int
        sliding_window_size=hf.get("sliding_window"),
        use_rotary_embeddings=True, vocab_size=hf["vocab_size"],
    )  # fmt: skip


def config_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.hf_fields import refuse

    if not mc.use_rotary_embeddings:
        refuse(HF, "`use_rotary_embeddings: false` (HF's Starcoder2 always applies RoPE)")
    if mc.sliding_window_size is not None and mc.global_attn_layers:
        refuse(HF, "global_attn_layers with a sliding window (HF's Starcoder2 slides every layer)")
    return {
        "architectures": [HF], "model_type": "starcoder2",
        "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
        "intermediate_size": ffn_size(mc), "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": 1 if is_multi_query(mc) else mc.num_kv_heads,
        "hidden_act": mc.activation_function, "max_position_embeddings": mc.max_position_embeddings,
        "initializer_range": mc.initializer_range, "norm_epsilon": mc.layer_norm_epsilon,
        "use_cache": True, "bos_token_id": mc.bos_token_id, "eos_token_id": mc.eos_token_id,
        "pad_token_id": None, "rope_theta": float(mc.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(mc.rope_theta)},
        "sliding_window": mc.sliding_window_size, "attention_dropout": mc.attn_pdrop,
        "residual_dropout": mc.resid_pdrop, "embedding_dropout": mc.embd_pdrop, "use_bias": True,
        "tie_word_embeddings": True, "torch_dtype": dtype, "dtype": dtype,
    }  # fmt: skip


def _attn(i: int, proj: str, leaf: str) -> str:
    return f"model.layers.{i}.self_attn.{proj}.{leaf}"


def _grouped(mc) -> tuple[int, int, int]:
    """(key/value heads, query heads per group, head dim) of a grouped-query config."""
    dh = mc.hidden_size // mc.num_attention_heads
    return mc.num_kv_heads, mc.num_attention_heads // mc.num_kv_heads, dh


def weights_to_hf(weights: dict, mc) -> dict:
    """Our fused projections (HF-named) split into HF's q_proj, k_proj, v_proj."""
    out = dict(weights)
    for i in range(mc.num_hidden_layers):
        for leaf in ("weight", "bias"):
            if is_multi_query(mc):
                t = out.pop(_attn(i, "kv_proj", leaf))
                q, (k, v) = out.pop(_attn(i, "q_proj", leaf)), t.chunk(2)
            else:
                nkv, group, dh = _grouped(mc)
                t = out.pop(_attn(i, "qkv_proj", leaf))  # per key/value head: its group, k, v
                q, k, v = t.view(nkv, group + 2, dh, *t.shape[1:]).split([group, 1, 1], 1)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                out[_attn(i, proj, leaf)] = part.reshape(-1, *t.shape[1:]).contiguous()
    return out


def weights_from_hf(weights: dict, mc) -> dict:
    """HF's q_proj, k_proj, v_proj fused as our model holds them (the reverse of
    `weights_to_hf`)."""
    import torch

    out = dict(weights)
    for i in range(mc.num_hidden_layers):
        for leaf in ("weight", "bias"):
            q, k, v = (out.pop(_attn(i, p, leaf), None) for p in ("q_proj", "k_proj", "v_proj"))
            if q is None or k is None or v is None:
                continue  # `hf_to_ours` names what is missing
            if is_multi_query(mc):
                out[_attn(i, "q_proj", leaf)] = q
                out[_attn(i, "kv_proj", leaf)] = torch.cat([k, v])
            else:
                nkv, group, dh = _grouped(mc)
                heads = [t.reshape(nkv, -1, dh, *t.shape[1:]) for t in (q, k, v)]
                out[_attn(i, "qkv_proj", leaf)] = torch.cat(heads, 1).reshape(-1, *q.shape[1:])
    return out


# names as Llama's (a `model.` prefix); our fused projections split in `weights_to_hf`
HF_SPEC = HFSpec((HF,), "starcoder2", config_from_hf, config_to_hf, llama_spec.ours_to_hf,
                 llama_spec.hf_to_ours, weights_to_hf, weights_from_hf)  # fmt: skip

STARCODER2 = ModelSpec(
    family="starcoder2",
    config_class=Starcoder2Config,
    shape=shape,
    build=build,
    tp_plan=tp_plan,
    compile_classes=compile_classes,
    blocks=blocks,
    config_sizes=config_sizes,
    config_errors=config_errors,
    nanotron_layer=nanotron_layer,
    nanotron_outer=NANOTRON_OUTER,
    param_shapes=param_shapes,
    init_std=init_std,
    step_flops=step_flops,
    pipeline_costs=pipeline_costs,
    hf=(HF_SPEC,),
    mup=False,  # Nanotron defines spectral µP for Llama and Qwen2 only
    dropout=has_dropout,
    llama_activations=False,  # LayerNorms, a two-matrix MLP, dropout masks, explicit attention
)
