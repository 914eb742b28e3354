"""Llama's spec: everything about the family outside `models/llama.py`.

A row of `NANOTRON_LAYER` names our tensors that make one fused Nanotron parameter (concatenated
on dim 0, each TP rank holding its slice of every chunk) and its TP kind
(docs/nanotron-layout.md#llamas-parameters). HF names are ours with a `model.` prefix.
"""

from __future__ import annotations

import math

from mesh3d.config.schema import LlamaConfig
from mesh3d.errors import ConfigError
from mesh3d.models.llama_checks import llama_errors, llama_sizes
from mesh3d.models.spec import Blocks, HFSpec, LayerTable, ModelShape, ModelSpec, decoder_cost
from mesh3d.nanotron_names import EMBEDDING, FINAL_NORM, LM_HEAD

# In the order of Nanotron's Llama decoder layer (`models/llama.py`), which its optimizer files keep
NANOTRON_LAYER: LayerTable = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "attn.qkv_proj.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "column",
    ),
    "attn.o_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "post_attention_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "column"),
    "mlp.down_proj.weight": (("mlp.down_proj.weight",), "row"),
}
# Outside the decoder: Nanotron name <- (our names, kind, pipeline end holding it).
NANOTRON_OUTER = {
    EMBEDDING: (("embed_tokens.weight",), "vocab", "first"),
    FINAL_NORM: (("norm.weight",), "replicated", "last"),
    LM_HEAD: (("lm_head.weight",), "vocab", "last"),  # absent when embeddings are tied
}
SCALING_METHODS = ("NUM_LAYERS", "NONE")


def shape(mc, padded_vocab: int) -> ModelShape:
    return ModelShape(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_heads=mc.num_attention_heads,
        num_kv_heads=mc.num_key_value_heads or mc.num_attention_heads,
        padded_vocab=padded_vocab,
        tied=mc.tie_word_embeddings,
        family="llama",
    )


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.llama import Llama

    return Llama(mc, vocab_size=vocab_size, attention=attention)


def tp_plan(sequence_parallel: bool, shape: ModelShape | None = None) -> dict:
    """The plan for `tp_mode` REDUCE_SCATTER (True) or ALL_REDUCE (False); every layer alike.

    Sequence parallel shards the residual stream and the norms on the sequence dim.

    Example:

        mesh3d.apply_tp(llama, mesh["tp"], mesh3d.llama_tp_plan(sequence_parallel=True))
    """
    from mesh3d import tp_styles as ts

    act = ts.Shard(1) if sequence_parallel else ts.Replicate()  # [B, S, h]: the sequence is dim 1

    def norm():  # each rank's rows under sequence parallelism: partial weight gradients
        return ts.LocalReplicated(partial_grads=sequence_parallel)

    block_in = ts.block_input(act)
    layer = {
        "input_layernorm": norm(),
        "self_attn": block_in,
        "self_attn.q_proj": ts.LocalColwise(),
        "self_attn.k_proj": ts.LocalColwise(),
        "self_attn.v_proj": ts.LocalColwise(),
        "self_attn.o_proj": ts.LocalRowwise(output_layouts=act),
        "post_attention_layernorm": norm(),
        "mlp": block_in,
        "mlp.gate_proj": ts.LocalColwise(),
        "mlp.up_proj": ts.LocalColwise(),
        "mlp.down_proj": ts.LocalRowwise(output_layouts=act),
    }
    return {
        "embed_tokens": ts.LocalEmbedding(input_layouts=ts.Replicate(), output_layouts=act),
        **{f"layers.*.{k}": v for k, v in layer.items()},
        "norm": norm(),
        "lm_head": ts.LocalHead(act),
    }


def compile_classes(tensor_parallel: bool) -> tuple[type, ...]:
    """The blocks `mesh3d.compile` compiles per layer (norms only without tp: DTensor hooks)."""
    from mesh3d.models.llama import MLP, Attention, RMSNorm

    return (Attention, MLP) if tensor_parallel else (Attention, MLP, RMSNorm)


def blocks() -> Blocks:
    """Attention modules (context parallelism); Llama has no MoE blocks."""
    from mesh3d.models.llama import Attention

    return Blocks(attention=(Attention,), moe=())


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    return NANOTRON_LAYER


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> full shape (embedding and head at the padded vocab)."""
    h, f = s.hidden_size, s.intermediate_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    shapes = {"embed_tokens.weight": (s.padded_vocab, h), "norm.weight": (h,),
              "lm_head.weight": (s.padded_vocab, h)}  # fmt: skip
    for i in range(s.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def init_std(name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"):
    """Nanotron's RandomInit std for parameter `name`: None (ones) for norms, 0 for biases
    (docs/nanotron-layout.md#initialization)."""
    if scaling_method not in SCALING_METHODS:
        raise ConfigError(
            f"`model.init_method.scaling_method` {scaling_method!r} is not supported; "
            f"use one of {SCALING_METHODS}"
        )
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    feeds_residual = ("o_proj.weight", "down_proj.weight", "experts.merged_down_proj")
    if scaling_method == "NUM_LAYERS" and name.endswith(feeds_residual):
        return std / math.sqrt(2 * num_layers)
    return std


def step_flops(s: ModelShape, seq_len: int, batch_size: int) -> float:
    """Model FLOPs of one step (3x forward) at a global batch of `batch_size` samples
    (docs/nanotron-layout.md#flops-and-mfu)."""
    L, h, nq, nkv, F = s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.intermediate_size
    V, S, B, dh = s.padded_vocab, seq_len, batch_size, s.head_dim
    qkv = 2 * L * B * S * h * nq * dh + 2 * L * B * S * h * 2 * nkv * dh
    attn = 2 * L * B * nq * S * dh * S + 2 * L * B * nq * S * S * dh
    out = 2 * L * B * nq * S * dh * h
    mlp = 4 * L * B * S * h * F + 2 * L * B * S * F * h
    head = 2 * B * S * h * V
    return 3.0 * (qkv + attn + out + mlp + head)


def pipeline_costs(s: ModelShape) -> tuple[list[int], int]:
    """Nanotron's cost of each decoder layer and of the lm_head
    (docs/nanotron-layout.md#pipeline-stages)."""
    cost = decoder_cost(s.hidden_size, s.intermediate_size, s.num_heads, s.head_dim)
    return [cost] * s.num_layers, s.padded_vocab * s.hidden_size


def ours_to_hf(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def hf_to_ours(name: str) -> str | None:
    # None: rotary_emb.inv_freq, a cache some older checkpoints carry
    return None if name.endswith("rotary_emb.inv_freq") else name.removeprefix("model.")


def config_from_hf(hf: dict, where) -> LlamaConfig:
    """Nanotron's LlamaConfig for an HF Llama `config.json` (vocab unpadded, as in HF)."""
    from mesh3d.models.hf_fields import check_head_dim, common_fields, refuse

    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(where, f"`{key}: true` (mesh3d's Llama has no biases)")
    fields = common_fields(hf, where)
    check_head_dim(hf, where, "Llama")
    return LlamaConfig(**fields, pretraining_tp=hf.get("pretraining_tp", 1), rope_interleaved=False)


def config_to_hf(mc, dtype: str) -> dict:
    """`config.json` of `LlamaForCausalLM`, in both the transformers 4 and 5 rope forms."""
    from mesh3d.models.hf_fields import common_hf

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common_hf(mc, dtype),
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": mc.hidden_size // mc.num_attention_heads,
        "pretraining_tp": mc.pretraining_tp,
    }


LLAMA = ModelSpec(
    family="llama", config_class=LlamaConfig, shape=shape, build=build, tp_plan=tp_plan,
    compile_classes=compile_classes, blocks=blocks, config_sizes=llama_sizes,
    config_errors=llama_errors, mup=True, nanotron_layer=nanotron_layer,
    nanotron_outer=NANOTRON_OUTER, param_shapes=param_shapes, init_std=init_std,
    step_flops=step_flops, pipeline_costs=pipeline_costs,
    hf=(HFSpec(("LlamaForCausalLM",), "llama", config_from_hf, config_to_hf, ours_to_hf, hf_to_ours),),
)  # fmt: skip
llama_tp_plan = tp_plan  # the public name (mesh3d.llama_tp_plan)
