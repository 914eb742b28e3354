"""Nanotron's checkpoint format as data: TP kinds, name prefixes, file names, versions.

A leaf (no mesh3d import); docs/nanotron-layout.md describes the format.
"""

from __future__ import annotations

from typing import Literal

# How Nanotron splits a parameter over TP (see SPLIT_DIM)
Kind = Literal["vocab", "column", "row", "replicated"]

# kind -> the dim Nanotron splits over TP (None: every TP rank holds a full copy).
#   vocab:      embedding / lm_head rows [t*V/T, (t+1)*V/T), one contiguous block
#   column:     fused column-parallel; each chunk (one of our tensors) split evenly on dim 0
#   row:        row-parallel, columns [t*in/T, (t+1)*in/T)
#   replicated: RMSNorm weights, written once, without a rank suffix
#   (docs/nanotron-layout.md#tied-and-replicated-parameters)
SPLIT_DIM: dict[Kind, int | None] = {"vocab": 0, "column": 0, "row": 1, "replicated": None}

# Where a decoder layer's parameters live, in Nanotron's names and ours.
LAYER_PREFIX_NANOTRON = "model.decoder.{i}.pp_block."
LAYER_PREFIX_OURS = "layers.{i}."
# Outside the decoder, the same in every Nanotron family.
EMBEDDING = "model.token_position_embeddings.pp_block.token_embedding.weight"
FINAL_NORM = "model.final_layer_norm.pp_block.weight"
LM_HEAD = "model.lm_head.pp_block.weight"

# File names (docs/nanotron-layout.md#weight-files): `<leaf>` is the last name component ("weight").
SHARDED_FILE = "model_{leaf}_pp-rank-{pp_rank}-of-{pp}_tp-rank-{tp_rank}-of-{tp}.safetensors"
SHARDED_FILE_REGEX = r"model_{leaf}_pp-rank-(\d+)-of-(\d+)_tp-rank-(\d+)-of-(\d+)\.safetensors"
UNSHARDED_FILE = "model_{leaf}.safetensors"
# an expert stack split over ep > 1 ranks (rows ep_rank·E/ep ..)
EXPERT_FILE = (
    "model_{leaf}_pp-rank-{pp_rank}-of-{pp}_tp-rank-{tp_rank}-of-{tp}"
    "_exp-rank-{ep_rank}-of-{ep}.safetensors"
)
EXPERT_FILE_REGEX = r"model_{leaf}_pp-rank-(\d+)-of-(\d+)_tp-rank-(\d+)-of-(\d+)_exp-rank-(\d+)-of-(\d+)\.safetensors"
EXPERT_STACKS = ("experts.merged_gate_up_proj", "experts.merged_down_proj")
BAD_NAMING_GLOB = "model_model_*"  # checkpoint 1.3's doubled names
TENSOR_KEY = "data"

# Checkpoint versions (docs/nanotron-layout.md#versions): we write CLASSIC's; we read up to HEAD's
# (same layout).
WRITE_VERSION = "1.4"
MAX_READ_VERSION = (1, 5)
