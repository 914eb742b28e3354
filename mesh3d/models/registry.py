"""The model families mesh3d trains, one line each (docs/adding-a-family.md), and their look-ups.

A spec is imported when first asked for, so a Llama run loads no other family's code. No torch.
"""

from __future__ import annotations

import importlib

from mesh3d.config.derive import padded_vocab_size
from mesh3d.errors import ConfigError
from mesh3d.models.spec import HFSpec, ModelShape, ModelSpec

# family -> (the spec's module, its name there, the model config class it reads)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "llama": ("mesh3d.models.llama_spec", "LLAMA", "LlamaConfig"),
    "qwen2": ("mesh3d.models.qwen2_spec", "QWEN2", "Qwen2Config"),
    "qwen3": ("mesh3d.models.qwen3_spec", "QWEN3", "Qwen3Config"),
    "starcoder2": ("mesh3d.models.starcoder2_spec", "STARCODER2", "Starcoder2Config"),
    "mamba": ("mesh3d.models.mamba_spec", "MAMBA", "MambaConfig"),
    "llamoe": ("mesh3d.models.llamoe_spec", "LLAMOE", "LlaMoEConfig"),
}


def families() -> list[str]:
    return list(FAMILIES)


def spec_of(model_config) -> ModelSpec:
    """The spec of a model config object (a LlamaConfig, Qwen2Config, ...)."""
    name = type(model_config).__name__
    for family, (_, _, config_class) in FAMILIES.items():
        if name == config_class:
            spec = spec_named(family)
            if type(model_config) is spec.config_class:
                return spec
    family = name.removesuffix("Config")
    raise ConfigError(
        f"model family {family} is not supported by mesh3d yet; supported: {', '.join(FAMILIES)}"
    )


def spec_named(family: str) -> ModelSpec:
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")
    module, attribute, _ = FAMILIES[family]
    return getattr(importlib.import_module(module), attribute)


def shape_of(model_config, padded_vocab: int) -> ModelShape:
    """The ModelShape of a family's model config at `padded_vocab` rows of embedding."""
    return spec_of(model_config).shape(model_config, padded_vocab)


def model_shape(cfg) -> ModelShape:
    """The ModelShape of a loaded `Config` (vocabulary padded for its tp).

    Example:

        shape = mesh3d.model_shape(cfg)
        shape.head_dim, shape.family
    """
    return shape_of(cfg.model.model_config, padded_vocab_size(cfg))


def spec_for_hf(hf_config: dict) -> tuple[ModelSpec, HFSpec] | None:
    """The spec and HF architecture matching a config.json's `model_type` and `architectures`."""
    archs = set(hf_config.get("architectures") or [])
    for spec in map(spec_named, FAMILIES):
        for hf in spec.hf:
            if hf_config.get("model_type") == hf.model_type and (
                not archs or archs & set(hf.architectures)
            ):
                return spec, hf
    return None
