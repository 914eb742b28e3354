"""The model families mesh3d trains, one line each, and the look-ups every other part uses.

Adding a family: its model (`models/<family>.py`), its spec (`models/<family>_spec.py`, a
`ModelSpec`) and one line in `SPECS` below (docs/adding-a-family.md). Nothing else names a
family: the config checks, `parallel/`, `checkpoint/`, `train/`, `plan/` and generation ask
this module for the spec. No torch at import (the spec modules import it only when called).

    spec = spec_of(cfg.model.model_config)   # the spec of a typed model config
    shape = model_shape(cfg)                 # its ModelShape at the config's padded vocabulary
"""

from __future__ import annotations

from mesh3d.config.derive import padded_vocab_size
from mesh3d.errors import ConfigError
from mesh3d.models.llama_spec import LLAMA
from mesh3d.models.qwen2_spec import QWEN2
from mesh3d.models.qwen3_spec import QWEN3
from mesh3d.models.spec import HFSpec, ModelShape, ModelSpec
from mesh3d.models.starcoder2_spec import STARCODER2

SPECS: dict[str, ModelSpec] = {spec.family: spec for spec in (LLAMA, QWEN2, QWEN3, STARCODER2)}


def families() -> list[str]:
    return list(SPECS)


def spec_of(model_config) -> ModelSpec:
    """The spec of a model config object (a LlamaConfig, Qwen2Config, ...)."""
    for spec in SPECS.values():
        if type(model_config) is spec.config_class:
            return spec
    family = type(model_config).__name__.removesuffix("Config")
    raise ConfigError(
        f"model family {family} is not supported by mesh3d yet; supported: {', '.join(SPECS)}"
    )


def spec_named(family: str) -> ModelSpec:
    if family not in SPECS:
        raise ConfigError(f"unknown model family {family!r}; use one of {', '.join(SPECS)}")
    return SPECS[family]


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
    """The spec and HF architecture whose `model_type` matches a config.json (and its
    `architectures`, if listed), if any."""
    archs = set(hf_config.get("architectures") or [])
    for spec in SPECS.values():
        for hf in spec.hf:
            if hf_config.get("model_type") == hf.model_type and (
                not archs or archs & set(hf.architectures)
            ):
                return spec, hf
    return None
