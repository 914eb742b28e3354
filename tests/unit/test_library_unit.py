"""mesh3d as a library: the public names, a model of the user's own (not Llama) in 3D, a Hugging
Face `LlamaForCausalLM` under mesh3d's TP + DP, and `save_state` / `load_state` across layouts.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_library.py`."""

from __future__ import annotations

import mesh3d

PUBLIC = [
    "Config", "load_config", "config_from_dict", "apply_overrides", "validate",
    "ParallelDims", "init_distributed", "build_mesh", "mesh_from_config",
    "TPPlan", "apply_tp", "llama_tp_plan", "hf_llama_tp_plan", "parallelize_hf",
    "build_hf_stage",
    "apply_dp", "allreduce_gradients",
    "SCHEDULES", "split_layers", "build_stage", "build_schedule", "run_schedule",
    "normalized_loss", "clip_grad_norm",
    "save_state", "load_state", "export_hf", "ModelShape", "model_shape", "read_nanotron_weights", "write_nanotron_weights",
    "Nanoset", "DummyTokens", "microbatches",
    "Llama", "train", "make_plan",
    "UserError", "ConfigError",
]  # fmt: skip


def test_public_names_are_stable_and_documented():
    assert mesh3d.__all__ == PUBLIC  # an accidental removal or rename fails here
    for name in PUBLIC:
        obj = getattr(mesh3d, name)
        if callable(obj) and not isinstance(obj, dict) and name != "TPPlan":
            doc = obj.__doc__ or ""
            assert "Example:" in doc, f"mesh3d.{name} has no example in its docstring"
