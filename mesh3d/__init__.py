"""mesh3d: 3D-parallel LLM pretraining on PyTorch's own distributed primitives.

Use it through `recipes/train.py`, the benchmarks, or as a library (docs/library.md,
`recipes/custom_model.py`):

    import mesh3d
    mesh3d.init_distributed()
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=2, tp=2, pp=2), "cpu")
    stage = mesh3d.build_stage(model, pp_rank, 2, layers, blocks="h", first=("wte",), last=("head",))
    mesh3d.apply_tp(stage, mesh["tp"], MY_PLAN)                # {FQN pattern: ParallelStyle}

Every name in `__all__` is public and stable; everything else is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mesh3d.log import quiet_known_import_noise

quiet_known_import_noise()  # before any import of transformers or torchao (see mesh3d.log)

if TYPE_CHECKING:  # at run time these load on first use
    from mesh3d.checkpoint.any_model import load_state, save_state
    from mesh3d.checkpoint.hf_export import export_hf
    from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights, write_nanotron_weights
    from mesh3d.checks import validate
    from mesh3d.config import apply_overrides, config_from_dict, load_config
    from mesh3d.config.schema import Config
    from mesh3d.data.dummy import DummyTokens, microbatches
    from mesh3d.data.nanoset import Nanoset
    from mesh3d.errors import ConfigError, UserError
    from mesh3d.hf_models import hf_llama_tp_plan, parallelize_hf
    from mesh3d.hf_stages import build_hf_stage
    from mesh3d.mesh import ParallelDims, build_mesh, init_distributed, mesh_from_config
    from mesh3d.models.llama import Llama
    from mesh3d.models.llama_spec import llama_tp_plan
    from mesh3d.models.registry import model_shape
    from mesh3d.models.spec import ModelShape
    from mesh3d.parallel.data import allreduce_gradients
    from mesh3d.parallel.fsdp import apply_dp
    from mesh3d.parallel.pipeline import (
        SCHEDULES,
        build_schedule,
        build_stage,
        run_schedule,
        split_layers,
    )
    from mesh3d.parallel.tensor import apply_tp
    from mesh3d.plan import make_plan
    from mesh3d.tp_styles import TPPlan
    from mesh3d.train.loop import train
    from mesh3d.train.loss import normalized_loss
    from mesh3d.train.step import clip_grad_norm

# module -> its public names, loaded lazily (PEP 562): `import mesh3d.config` stays free of torch
# and `python -m mesh3d.plan` does not import itself twice.
_PUBLIC = {
    "mesh3d.config.schema": ("Config",),  # config
    "mesh3d.config": ("load_config", "config_from_dict", "apply_overrides"),
    "mesh3d.checks": ("validate",),
    "mesh3d.mesh": ("ParallelDims", "init_distributed", "build_mesh", "mesh_from_config"),
    "mesh3d.tp_styles": ("TPPlan",),  # tensor parallelism
    "mesh3d.parallel.tensor": ("apply_tp",),
    "mesh3d.models.llama_spec": ("llama_tp_plan",),
    "mesh3d.hf_models": ("hf_llama_tp_plan", "parallelize_hf"),
    "mesh3d.hf_stages": ("build_hf_stage",),
    "mesh3d.parallel.fsdp": ("apply_dp",),  # data parallelism
    "mesh3d.parallel.data": ("allreduce_gradients",),
    "mesh3d.parallel.pipeline": (  # pipeline parallelism
        "SCHEDULES", "split_layers", "build_stage", "build_schedule", "run_schedule",
    ),
    "mesh3d.train.loss": ("normalized_loss",),  # loss and step
    "mesh3d.train.step": ("clip_grad_norm",),
    "mesh3d.checkpoint.any_model": ("save_state", "load_state"),  # checkpoints
    "mesh3d.checkpoint.hf_export": ("export_hf",),
    "mesh3d.models.spec": ("ModelShape",),
    "mesh3d.models.registry": ("model_shape",),
    "mesh3d.checkpoint.nanotron_weights": ("read_nanotron_weights", "write_nanotron_weights"),
    "mesh3d.data.nanoset": ("Nanoset",),  # data
    "mesh3d.data.dummy": ("DummyTokens", "microbatches"),
    "mesh3d.models.llama": ("Llama",),  # the Llama trainer
    "mesh3d.train": ("train",),  # the package, callable as the run (mesh3d/train/__init__.py)
    "mesh3d.plan": ("make_plan",),
    "mesh3d.errors": ("UserError", "ConfigError"),  # errors
}  # fmt: skip
_EXPORTS = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name == "train":  # the package, which sets itself here on import (and is callable)
        return importlib.import_module("mesh3d.train")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mesh3d' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"
