"""Nanotron's Llama parameter names and TP kinds as data (spec §4.1-4.3).

Our model keeps q/k/v and gate/up separate (HF names); Nanotron fuses them into `qkv_proj` and
`gate_up_proj`, each TP rank holding its slice of every chunk. A row of these tables says which
of our tensors make one Nanotron parameter (concatenated on dim 0 in that order, each one a
chunk) and how Nanotron shards it over TP.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["vocab", "column", "row", "replicated"]

# kind -> the dim Nanotron splits over TP (None: every TP rank holds a full copy).
#   vocab:      embedding / lm_head rows [t*V/T, (t+1)*V/T), one contiguous block
#   column:     fused column-parallel; each chunk (one of our tensors) split evenly on dim 0
#   row:        row-parallel, columns [t*in/T, (t+1)*in/T)
#   replicated: RMSNorm weights, written once, without a rank suffix (spec §3.5)
SPLIT_DIM: dict[Kind, int | None] = {"vocab": 0, "column": 0, "row": 1, "replicated": None}

# Per decoder layer i: Nanotron `model.decoder.{i}.pp_block.<key>` <- our `layers.{i}.<parts>`.
LAYER_PARAMS: dict[str, tuple[tuple[str, ...], Kind]] = {
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
LAYER_PREFIX_NANOTRON = "model.decoder.{i}.pp_block."
LAYER_PREFIX_OURS = "layers.{i}."

# Outside the decoder: Nanotron name <- (our names, kind, pipeline end holding it).
EMBEDDING = "model.token_position_embeddings.pp_block.token_embedding.weight"
LM_HEAD = "model.lm_head.pp_block.weight"
OUTER_PARAMS: dict[str, tuple[tuple[str, ...], Kind, Literal["first", "last"]]] = {
    EMBEDDING: (("embed_tokens.weight",), "vocab", "first"),
    "model.final_layer_norm.pp_block.weight": (("norm.weight",), "replicated", "last"),
    LM_HEAD: (("lm_head.weight",), "vocab", "last"),  # absent when embeddings are tied
}

# File names (spec §3.3): `<leaf>` is the last name component ("weight").
SHARDED_FILE = "model_{leaf}_pp-rank-{pp_rank}-of-{pp}_tp-rank-{tp_rank}-of-{tp}.safetensors"
SHARDED_FILE_REGEX = r"model_{leaf}_pp-rank-(\d+)-of-(\d+)_tp-rank-(\d+)-of-(\d+)\.safetensors"
UNSHARDED_FILE = "model_{leaf}.safetensors"
BAD_NAMING_GLOB = "model_model_*"  # checkpoint 1.3's doubled names (spec §3.3)
TENSOR_KEY = "data"

# Checkpoint versions (spec §3.13): we write CLASSIC's; we read up to HEAD's (same layout).
WRITE_VERSION = "1.4"
MAX_READ_VERSION = (1, 5)
