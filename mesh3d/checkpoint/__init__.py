"""The only code that knows on-disk checkpoint formats (Nanotron's layout; spec §3, §4).

    full = {name: tensor for name, tensor in model.state_dict().items()}  # full, unsharded
    write_nanotron_weights(step_dir / "model", full, ModelShape.from_config(cfg), tp=2, pp=2)
    full = read_nanotron_weights(step_dir / "model", ModelShape.from_config(cfg))  # any tp/pp

Files: `names.py` (Nanotron names, TP kinds, file names as tables), `nanotron_weights.py`
(full tensors <-> Nanotron's per-rank safetensors files).
"""

from mesh3d.checkpoint.nanotron_weights import (
    ModelShape,
    model_config_json,
    nanotron_params,
    nanotron_shards,
    read_nanotron_weights,
    write_nanotron_weights,
)

__all__ = [
    "ModelShape",
    "model_config_json",
    "nanotron_params",
    "nanotron_shards",
    "read_nanotron_weights",
    "write_nanotron_weights",
]
