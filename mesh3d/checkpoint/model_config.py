"""A step folder's `model_config.json` (Nanotron's keys, padded vocabulary), read back as
mesh3d's typed config of its family."""

from __future__ import annotations

import json
from pathlib import Path

from mesh3d.config.load import model_config_from_dict
from mesh3d.errors import ConfigError, UserError
from mesh3d.models import registry
from mesh3d.models.registry import spec_of
from mesh3d.models.spec import ModelShape


def _read_json_object(path: Path, missing: str) -> dict:
    """The JSON object in `path`; `missing` is the error when the file is absent."""
    if not path.is_file():
        raise UserError(missing)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"{path} must hold a JSON object")
    return d


def read_model_config_json(step: Path):
    """The model config in `<step>/model_config.json`, any family."""
    path = step / "model_config.json"
    d = _read_json_object(path, f"{step} has no model_config.json; give a checkpoint step folder")
    try:
        mc = model_config_from_dict(d, str(path))
    except ConfigError as e:
        raise UserError(f"{path} is not a model config mesh3d reads: {e}") from None
    spec_of(mc)  # "not supported by mesh3d yet" for another family
    if hasattr(mc, "num_key_value_heads") and mc.num_key_value_heads is None:
        mc.num_key_value_heads = mc.num_attention_heads  # as loading a config fills it
    return mc


def shape_of(mc) -> ModelShape:
    """The `ModelShape` of `mc` (its vocab_size taken as the padded one)."""
    return registry.shape_of(mc, mc.vocab_size)
