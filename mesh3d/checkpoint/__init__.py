"""The only code that knows on-disk checkpoint formats (Nanotron's layout).

    write_nanotron_weights(step_dir / "model", full, model_shape(cfg), tp=2, pp=2)
    full = read_nanotron_weights(step_dir / "model", model_shape(cfg))  # any tp/pp

Nanotron's names and file patterns are in `mesh3d/nanotron_names.py`. The names below load on
first use, so `import mesh3d.checkpoint` stays free of torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "model_config_json": "mesh3d.checkpoint.nanotron_weights",
    "nanotron_params": "mesh3d.checkpoint.nanotron_weights",
    "nanotron_shards": "mesh3d.checkpoint.nanotron_weights",
    "read_nanotron_weights": "mesh3d.checkpoint.nanotron_weights",
    "write_nanotron_weights": "mesh3d.checkpoint.nanotron_weights",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mesh3d.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
