"""The checks of a `rope_scaling`, loaded only for a config that gives one."""

from __future__ import annotations

import math
from collections.abc import Iterator

MC = "model.model_config"

# what `rope_inv_freq` (models/llama.py) reads of a llama3 `rope_scaling`; its only scaling
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LLAMA3_FORM = f"rope_type llama3 with {', '.join(LLAMA3_KEYS)}"
LLAMA31 = "rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192"


def rope_scaling_errors(scaling: dict) -> Iterator[str]:
    """`rope_scaling` as `rope_inv_freq` computes it: null, rope_type default alone, or llama3
    with its four numbers; any other form would crash there or be silently ignored."""
    key = f"{MC}.rope_scaling"
    if "rope_type" in scaling and "type" in scaling and scaling["rope_type"] != scaling["type"]:
        yield f"`{key}` gives rope_type {scaling['rope_type']!r} and type {scaling['type']!r}; give one, llama3 (or set rope_scaling to null)"
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))  # "type": older HF configs
    if kind not in ("default", "llama3"):
        yield f"`{key}` rope_type {kind!r} is not supported; mesh3d implements {LLAMA3_FORM} (Llama 3.1's scaling), or null for none"
        return
    read = ("rope_type", "type", *LLAMA3_KEYS) if kind == "llama3" else ("rope_type", "type")
    extra = [str(k) for k in scaling if k not in read]
    if kind == "default":
        if extra:
            yield f"`{key}` {scaling!r} names no rope_type llama3, so {', '.join(extra)} would be ignored; use {LLAMA3_FORM}, or set rope_scaling to null"
        return
    if extra:
        yield f"`{key}` has keys llama3 scaling does not read: {', '.join(extra)}; remove them (it reads {', '.join(LLAMA3_KEYS)})"
    if missing := [k for k in LLAMA3_KEYS if k not in scaling]:
        yield (f"`{key}` (rope_type llama3) lacks {', '.join(missing)}; llama3 scaling needs all four, "
               f"e.g. Llama 3.1's {{{LLAMA31}}}")  # fmt: skip
        return
    numbers = [k for k in LLAMA3_KEYS[:3] if _positive_number(scaling[k])]
    for k in LLAMA3_KEYS[:3]:
        if k not in numbers:
            yield f"`{key}.{k}` must be a finite number > 0, got {scaling[k]!r}"
    old = scaling["original_max_position_embeddings"]
    if isinstance(old, bool) or not isinstance(old, int) or old < 1:
        yield f"`{key}.original_max_position_embeddings` must be an integer >= 1 (the context length before scaling, e.g. 8192), got {old!r}"
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    if len(numbers) == 3 and high <= low:
        yield f"`{key}.high_freq_factor` ({high}) must be greater than low_freq_factor ({low}): the wavelengths between them are interpolated"


def _positive_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v > 0
