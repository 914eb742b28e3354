"""The `config.json` fields the Llama-like families share, both ways
(docs/nanotron-layout.md#hugging-face-names); torch-free.

Reads both forms transformers writes: version 4 (top-level `rope_theta` / `rope_scaling`) and
version 5 (`rope_parameters`), and writes both. The family specs add their own fields.
"""

from __future__ import annotations

from mesh3d.errors import UserError
from mesh3d.models.activations import HIDDEN_ACTS

SUPPORTED_ROPE_TYPES = ("default", "llama3")
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")


def refuse(where, what: str):
    raise UserError(f"{where}: {what} is not supported by mesh3d")


def check_head_dim(hf: dict, where, family: str) -> None:
    """Refuse a `head_dim` other than hidden_size / num_attention_heads, naming all three."""
    h, nq, hd = hf["hidden_size"], hf["num_attention_heads"], hf.get("head_dim")
    if hd not in (None, h // nq):
        raise UserError(
            f"{where}: head_dim {hd} differs from hidden_size {h} / num_attention_heads {nq} "
            f"= {h // nq}; mesh3d's {family} needs them equal (another head size is not "
            "supported): if hidden_size or num_attention_heads was edited, restore it"
        )


def hf_rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either transformers 4 or 5 `config.json`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"rope scaling type {kind!r} in config.json is not supported by mesh3d; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (or no rope_scaling)"
            )
        if kind == "default":
            scaling = None
    return float(theta), scaling or None


def common_fields(hf: dict, where) -> dict:
    """The Nanotron model-config fields every Llama-like family reads the same way."""
    act = hf.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        refuse(where, f"hidden_act {act!r} (use one of {', '.join(HIDDEN_ACTS)})")
    missing = [k for k in (*REQUIRED, "vocab_size") if k not in hf]
    if missing:
        raise UserError(f"{where} lacks {missing}; is it a complete model config?")
    theta, scaling = hf_rope(hf)
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):  # Llama 3.x instruct lists several; Nanotron keeps one int
        eos = eos[0]
    nq = hf["num_attention_heads"]
    return {
        "bos_token_id": hf.get("bos_token_id", 1),
        "eos_token_id": eos,
        "hidden_act": act,
        "hidden_size": hf["hidden_size"],
        "initializer_range": hf.get("initializer_range", 0.02),
        "intermediate_size": hf["intermediate_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "num_attention_heads": nq,
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_key_value_heads": hf.get("num_key_value_heads") or nq,
        "pad_token_id": hf.get("pad_token_id"),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_scaling": scaling,
        "rope_theta": theta,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "use_cache": hf.get("use_cache", True),
        "vocab_size": hf["vocab_size"],
    }


def common_hf(mc, dtype: str) -> dict:
    """The `config.json` fields every Llama-like family writes the same way."""
    scaling = dict(mc.rope_scaling) if getattr(mc, "rope_scaling", None) else None
    rope_parameters = dict(scaling or {"rope_type": "default"}, rope_theta=mc.rope_theta)
    if "type" in rope_parameters and "rope_type" not in rope_parameters:
        rope_parameters["rope_type"] = rope_parameters.pop("type")
    nq = mc.num_attention_heads
    return {
        "attention_dropout": 0.0,
        "bos_token_id": mc.bos_token_id,
        "eos_token_id": mc.eos_token_id,
        "pad_token_id": mc.pad_token_id,
        "hidden_act": mc.hidden_act,
        "hidden_size": mc.hidden_size,
        "initializer_range": mc.initializer_range,
        "intermediate_size": mc.intermediate_size,
        "max_position_embeddings": mc.max_position_embeddings,
        "num_attention_heads": nq,
        "num_hidden_layers": mc.num_hidden_layers,
        "num_key_value_heads": mc.num_key_value_heads or nq,
        "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": mc.use_cache,
        "vocab_size": mc.vocab_size,
    }
