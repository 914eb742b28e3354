"""The model families Nanotron lacks, as one table read by loading, checking and generation.

A YAML writes one as its base family's model_config plus `mesh3d: {model_family: <name>, <its
keys>}` (so Nanotron still loads it); its checkpoints' `model_config.json` has `<marker>: true`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh3dFamily:
    name: str  # the value of `mesh3d.model_family`
    classes: tuple[str, str]  # its model config class (a subclass of the next), the Nanotron
    # model_config class a YAML keeps; both in `config/other_families.py`, loaded when asked for
    keys: tuple[str, ...]  # its fields a YAML keeps in `mesh3d:` (Mesh3dArgs fields too)
    marker: str  # the `is_<name>_config` key of its model_config.json

    @property
    def config_class(self) -> type:
        return getattr(importlib.import_module("mesh3d.config.other_families"), self.classes[0])

    @property
    def base(self) -> type:
        return getattr(importlib.import_module("mesh3d.config.other_families"), self.classes[1])


MESH3D_FAMILIES: dict[str, Mesh3dFamily] = {
    "qwen3": Mesh3dFamily(
        "qwen3", ("Qwen3Config", "Qwen2Config"), ("head_dim", "norm_topk_prob"), "is_qwen3_config"
    ),
}


def family_keys() -> tuple[str, ...]:
    """Every `mesh3d:` key that shapes a model: `model_family` and each family's own keys."""
    return ("model_family", *dict.fromkeys(k for f in MESH3D_FAMILIES.values() for k in f.keys))


def family_of_config(model_config) -> Mesh3dFamily | None:
    """The table row whose config class `model_config` is, if any."""
    return next((f for f in MESH3D_FAMILIES.values() if type(model_config).__name__ == f.classes[0]
                 and type(model_config) is f.config_class), None)  # fmt: skip
