"""mesh3d as a library: the public names, a model of the user's own (not Llama) in 3D, a Hugging
Face `LlamaForCausalLM` under mesh3d's TP + DP, and `save_state` / `load_state` across layouts.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_library.py`."""

from __future__ import annotations

import sys

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


def test_mesh3d_train_stays_the_run_after_its_package_is_imported(monkeypatch):
    """`from mesh3d.train.hooks import ...` (as docs/library.md does) bound `mesh3d.train` to the
    package: `mesh3d.train(cfg, hooks=...)` then raised "'module' object is not callable". The
    package is callable as the run, whichever was imported first."""
    import mesh3d.train.hooks  # noqa: F401 - binds mesh3d.train to the package
    import mesh3d.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda *a: calls.append(a) or "result")
    assert callable(mesh3d.train) and mesh3d.train is sys.modules["mesh3d.train"]
    assert mesh3d.train("cfg", hooks=["h"]) == "result" and calls == [("cfg", None, ["h"])]
    from mesh3d import train

    assert train is mesh3d.train and "Example:" in train.__doc__


def test_apply_tp_refuses_a_plan_key_that_names_no_module():
    """`apply_tp(model, mesh, {"nothing.*": ColwiseParallel()})` left the model unsharded without
    a word, so a typo (`h.*.attn.cq`) went unnoticed; a key a pipeline stage deleted (a None
    child) or a `*` over an empty stage stays free."""
    import pytest
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel

    from mesh3d.errors import UserError
    from mesh3d.parallel.plan_keys import names_nothing as _names_nothing

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self, layers: int):
            super().__init__()
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.embed = None  # deleted by a pipeline stage

    model = Model(2)
    assert not _names_nothing(model, "h.*.attn") and not _names_nothing(model, "embed")
    assert not _names_nothing(Model(0), "h.*.attn")  # a stage without these layers
    assert _names_nothing(model, "h.*.attn.cq") and _names_nothing(model, "nothing.*")
    with pytest.raises(UserError) as e:
        mesh3d.apply_tp(model, None, {"h.*.attn": ColwiseParallel(), "h.*.atn": ColwiseParallel()})
    assert str(e.value).startswith("tp plan key(s) 'h.*.atn' name no submodule of Model; its "
                                   "submodules include h, h.*, h.*.attn, h.*.mlp"), e.value  # fmt: skip
