"""Nanotron's YAML config, read strictly, with mesh3d's optional `mesh3d:` section.

    cfg = load_config("config.yaml", ["parallelism.tp=2"])  # typed, derived values filled
    save_config(cfg, "out.yaml")                            # all keys, sorted, like Nanotron

Files: `schema.py` (the dataclasses), `typecheck.py` (strict mapping -> dataclass),
`overrides.py` (dotted `key=value`), `load.py` (YAML in/out, Nanotron's forms and derived values),
`derive.py` (computed values). Parsing only: the cross-checks (`mesh3d.checks.validate`) sit
above the model families, whose specs they consult.
"""

from __future__ import annotations

import importlib

# where the public names live: YAML in/out (`load_config`, `config_from_dict`, `save_config`,
# `apply_overrides`, `DEFAULT_CONFIG`, ...), derived values (`global_batch_size`, ...), and the
# schema's dataclasses (`Config`, `LlamaConfig`, ...); each loaded on first use
_MODULES = ("mesh3d.config.load", "mesh3d.config.derive", "mesh3d.config.schema")


def __getattr__(name: str):
    for module in _MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if found is not None and not name.startswith("_"):
            globals()[name] = found
            return found
    raise AttributeError(f"module 'mesh3d.config' has no attribute {name!r}")
