"""Hugging Face `config.json` <-> Nanotron `LlamaConfig` (spec §4.4), for `mesh3d.convert`.

Reads both forms transformers writes: version 4 (top-level `rope_theta` / `rope_scaling`) and
version 5 (`rope_parameters`). Only Llama, with default or llama3 rotary scaling.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mesh3d.config import LlamaConfig
from mesh3d.errors import UserError
from mesh3d.models.llama import ACTIVATIONS

SUPPORTED_ROPE_TYPES = ("default", "llama3")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


def llama_config_from_hf(hf: dict, where: Path) -> LlamaConfig:
    """Nanotron's LlamaConfig for an HF Llama `config.json` (vocab unpadded, as in HF)."""
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
        raise UserError(
            f"{where} is not a Llama config (model_type {hf.get('model_type')!r}, architectures "
            f"{archs}); mesh3d.convert handles LlamaForCausalLM only"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(
                f"{where}: `{key}: true` is not supported (mesh3d's Llama has no biases)"
            )
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UserError(
            f"{where}: hidden_act {act!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    missing = [
        k
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
        if k not in hf
    ]
    if missing or "vocab_size" not in hf:
        raise UserError(
            f"{where} lacks {missing or ['vocab_size']}; is it a complete Llama config?"
        )
    h, nq = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, h // nq):
        raise UserError(
            f"{where}: head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads "
            f"= {h // nq}; mesh3d's Llama does not support that"
        )
    theta, scaling = hf_rope(hf)
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):  # Llama 3.x instruct lists several; Nanotron keeps one int
        eos = eos[0]
    return LlamaConfig(
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_id=eos,
        hidden_act=act,
        hidden_size=h,
        initializer_range=hf.get("initializer_range", 0.02),
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        num_attention_heads=nq,
        num_hidden_layers=hf["num_hidden_layers"],
        num_key_value_heads=hf.get("num_key_value_heads") or nq,
        pad_token_id=hf.get("pad_token_id"),
        pretraining_tp=hf.get("pretraining_tp", 1),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_scaling=scaling,
        rope_theta=theta,
        rope_interleaved=False,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        use_cache=hf.get("use_cache", True),
        vocab_size=hf["vocab_size"],
    )


def hf_config_from_llama(mc: LlamaConfig, dtype: torch.dtype) -> dict:
    """`config.json` of `LlamaForCausalLM`, in both the transformers 4 and 5 rope forms."""
    scaling = dict(mc.rope_scaling) if mc.rope_scaling else None
    rope_parameters = dict(scaling or {"rope_type": "default"}, rope_theta=mc.rope_theta)
    if "type" in rope_parameters and "rope_type" not in rope_parameters:
        rope_parameters["rope_type"] = rope_parameters.pop("type")
    name = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    nq = mc.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": mc.bos_token_id,
        "eos_token_id": mc.eos_token_id,
        "pad_token_id": mc.pad_token_id,
        "head_dim": mc.hidden_size // nq,
        "hidden_act": mc.hidden_act,
        "hidden_size": mc.hidden_size,
        "initializer_range": mc.initializer_range,
        "intermediate_size": mc.intermediate_size,
        "max_position_embeddings": mc.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": nq,
        "num_hidden_layers": mc.num_hidden_layers,
        "num_key_value_heads": mc.num_key_value_heads or nq,
        "pretraining_tp": mc.pretraining_tp,
        "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": mc.tie_word_embeddings,
        "torch_dtype": name,
        "dtype": name,
        "use_cache": mc.use_cache,
        "vocab_size": mc.vocab_size,
    }
