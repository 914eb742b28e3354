"""Nanotron's YAML config, read strictly, with mesh3d's optional `mesh3d:` section.

    cfg = load_config("config.yaml", ["parallelism.tp=2"])  # typed, derived values filled
    save_config(cfg, "out.yaml")                            # all keys, sorted, like Nanotron

Parsing only: the cross-checks are `mesh3d.checks.validate`.
"""

from __future__ import annotations

import importlib

# where the public names live, each module loaded on first use
_MODULES = (
    "mesh3d.config.load",
    "mesh3d.config.derive",
    "mesh3d.config.schema",
    "mesh3d.config.other_families",
)


def __getattr__(name: str):
    for module in _MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if found is not None and not name.startswith("_"):
            globals()[name] = found
            return found
    raise AttributeError(f"module 'mesh3d.config' has no attribute {name!r}")
