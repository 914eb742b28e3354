"""The torch-free model-config checks of the Llama-like families (Qwen2's are in `qwen2_spec.py`).

The sizes (`llama_sizes`) are checked >= 1 first, so these never divide by zero."""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.derive import longest_sequence, padded_vocab_size
from mesh3d.errors import not_divisible
from mesh3d.models.activations import HIDDEN_ACTS

MC = "model.model_config"
# what `_attn_implementation` may say (Nanotron's values); mesh3d picks attention itself
ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flex_attention", "sdpa", "ring_flash_triton", "ring",
                        "llama3_ring_attention")  # fmt: skip


def llama_sizes(mc) -> dict[str, int]:
    """The sizes of a Llama-like model config that must be >= 1, by dotted key."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "num_key_value_heads", "vocab_size")  # fmt: skip
    return {f"{MC}.{k}": getattr(mc, k) for k in keys}


def llama_errors(cfg) -> Iterator[str]:
    """Heads, kv heads, MLP against tp; head size, rotary base, activation, positions, token ids."""
    mc, tp = cfg.model.model_config, cfg.parallelism.tp
    heads, kv = mc.num_attention_heads, mc.num_key_value_heads
    for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        yield from not_divisible(f"{MC}.{k}", getattr(mc, k), "parallelism.tp", tp,
                                 "choose a parallelism.tp that divides it")  # fmt: skip
    head_dim = getattr(mc, "head_dim", None)  # Qwen3's mesh3d.head_dim
    if head_dim is None:
        yield from not_divisible(f"{MC}.hidden_size", mc.hidden_size, f"{MC}.num_attention_heads",
                                 heads, "the head dimension is hidden_size / num_attention_heads")  # fmt: skip
    elif head_dim < 2 or head_dim % 2:
        yield f"`mesh3d.head_dim` ({head_dim}) must be an even number >= 2 (rotary embeddings pair its dims)"
    yield from not_divisible(f"{MC}.num_attention_heads", heads, f"{MC}.num_key_value_heads", kv,
                             "each key/value head serves a whole group of query heads")  # fmt: skip
    if head_dim is None and mc.hidden_size % heads == 0 and (mc.hidden_size // heads) % 2:
        yield f"the head dimension {MC}.hidden_size / num_attention_heads = {mc.hidden_size // heads} must be even for rotary embeddings"
    shard = padded_vocab_size(cfg) // tp
    if mc.pad_token_id is not None and not 0 <= mc.pad_token_id < shard:
        yield (
            f"`{MC}.pad_token_id` ({mc.pad_token_id}) must be in [0, {shard}): each of the tp ({tp}) "
            f"embedding shards holds {shard} rows of the padded vocab {padded_vocab_size(cfg)}; "
            "use a smaller id or null"
        )
    if mc._attn_implementation is not None and mc._attn_implementation not in ATTN_IMPLEMENTATIONS:
        yield f"`{MC}._attn_implementation` {mc._attn_implementation!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} (mesh3d picks attention from mesh3d.attention)"
    if mc.rms_norm_eps <= 0:
        yield f"`{MC}.rms_norm_eps` must be > 0, got {mc.rms_norm_eps}"
    if mc.z_loss_enabled and not mc.z_loss_coefficient > 0:
        yield f"`{MC}.z_loss_coefficient` must be > 0 with z_loss_enabled, got {mc.z_loss_coefficient}"
    if not (math.isfinite(mc.rope_theta) and mc.rope_theta > 0):
        yield f"`{MC}.rope_theta` must be a finite number > 0 (the rotary base, e.g. 10000.0), got {mc.rope_theta}"
    if mc.rope_scaling and not getattr(mc, "is_llamoe_config", False):  # LlaMoE's: null
        from mesh3d.models.rope_checks import rope_scaling_errors

        yield from rope_scaling_errors(mc.rope_scaling)
    if mc.hidden_act not in HIDDEN_ACTS:
        yield f"`{MC}.hidden_act` {mc.hidden_act!r} is not supported; use one of {', '.join(HIDDEN_ACTS)}"
    positions, (key, seq) = mc.max_position_embeddings, longest_sequence(cfg)
    if positions < 1:
        yield f"`{MC}.max_position_embeddings` must be >= 1, got {positions}"
    elif positions < seq and not getattr(mc, "is_llama_config", False):  # Llama: a warning
        yield (
            f"`{MC}.max_position_embeddings` ({positions}) is smaller than `{key}` "
            f"({seq}); raise max_position_embeddings to at least {seq} or lower sequence_length"
        )
    for k in ("bos_token_id", "eos_token_id"):
        token = getattr(mc, k)
        if token is not None and not 0 <= token < mc.vocab_size:
            yield f"`{MC}.{k}` ({token}) must be in [0, {MC}.vocab_size ({mc.vocab_size})); use an id of the vocabulary"
