"""The model families Nanotron lacks, as one table read by loading, checking and generation.

Such a family is written in a YAML as Nanotron's model_config of the family it extends plus
`mesh3d: {model_family: <name>, <its keys>}`, so the file still loads in Nanotron; the
`model_config.json` of its checkpoints carries `<marker>: true` and those keys instead.
`config/load.py` turns one form into the family's config class and back, `mesh3d/checks`
refuses a family key without its family, and `mesh3d generate` rebuilds the model from the
same keys saved with a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.config.schema import Qwen2Config, Qwen3Config


@dataclass(frozen=True)
class Mesh3dFamily:
    name: str  # the value of `mesh3d.model_family`
    config_class: type  # its model config dataclass (a subclass of `base`)
    base: type  # the Nanotron model_config a YAML keeps
    keys: tuple[str, ...]  # its fields a YAML keeps in `mesh3d:` (Mesh3dArgs fields too)
    marker: str  # the `is_<name>_config` key of its model_config.json


MESH3D_FAMILIES: dict[str, Mesh3dFamily] = {
    f.name: f
    for f in (
        Mesh3dFamily(
            "qwen3", Qwen3Config, Qwen2Config, ("head_dim", "norm_topk_prob"), "is_qwen3_config"
        ),
    )  # fmt: skip
}


def family_keys() -> tuple[str, ...]:
    """Every `mesh3d:` key that shapes a model: `model_family` and each family's own keys."""
    return ("model_family", *dict.fromkeys(k for f in MESH3D_FAMILIES.values() for k in f.keys))


def family_of_config(model_config) -> Mesh3dFamily | None:
    """The table row whose config class `model_config` is, if any."""
    for f in MESH3D_FAMILIES.values():
        if type(model_config) is f.config_class:
            return f
    return None
