"""`import mesh3d` used the way a newcomer does (found by a review of docs/library.md): a wrong
argument is refused by name with the fix, and nothing silently computes something else."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch import nn

import mesh3d
from mesh3d.train.run import Run

CONFIG = Path(mesh3d.__file__).parent / "configs" / "default.yaml"


def _grads() -> nn.Linear:
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    m(torch.randn(3, 4)).pow(2).sum().backward()
    return m


@pytest.mark.parametrize("as_given", [list, iter], ids=["list", "generator"])
def test_clip_grad_norm_clips_a_generator_of_parameters_too(as_given):
    m = _grads()
    before = torch.cat([p.grad.flatten() for p in m.parameters()]).norm()
    norm = mesh3d.clip_grad_norm(as_given(m.parameters()), 0.1)
    after = torch.cat([p.grad.flatten() for p in m.parameters()]).norm()
    assert norm == pytest.approx(float(before)) and norm > 1
    assert float(after) == pytest.approx(0.1, rel=1e-4)  # torch's idiom `m.parameters()` clips


def test_allreduce_gradients_needs_a_group():
    with pytest.raises(TypeError, match=r"data-parallel group, mesh\['dp'\].get_group\(\)"):
        mesh3d.allreduce_gradients(_grads(), None)


@pytest.mark.parametrize("tokens", [0, -4])
def test_normalized_loss_refuses_a_step_without_tokens(tokens):
    logits, labels = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    assert mesh3d.normalized_loss(logits, labels, 8, 6).isfinite()
    with pytest.raises(ValueError, match=f"global_tokens must be >= 1 .*, got {tokens}"):
        mesh3d.normalized_loss(logits, labels, 8, tokens)  # was inf: a silent diverged step


@pytest.mark.parametrize(
    "args", [(1, 7, 0, 2, 2), (1, 8, 0, 2, 3), (1, 8, 3, 2, 2), (0, 8, 0, 2, 2)],
    ids=["gbs-not-dp-multiple", "mbs-leaves-samples", "rank-outside-dp", "step-0"],
)  # fmt: skip
def test_microbatches_refuses_sizes_that_leave_samples_out(args):
    ds = mesh3d.DummyTokens(96, 16, 0)
    with pytest.raises(ValueError, match="none left out"):
        mesh3d.microbatches(ds, *args)
    batches = mesh3d.microbatches(ds, 1, 8, 1, 2, 2)  # a global batch of 8 over dp 2: 2 x 2 each
    assert [b[0].shape for b in batches] == [torch.Size([2, 16])] * 2


def test_a_file_name_where_a_config_is_needed_names_load_config():
    for call in (lambda: mesh3d.validate("cfg.yaml", 1), lambda: mesh3d.make_plan("cfg.yaml")):
        with pytest.raises(TypeError, match=r"a mesh3d.Config is needed, not str 'cfg.yaml'"):
            call()
    with pytest.raises(TypeError, match=r"mesh3d.config_from_dict\(mapping\)"):
        mesh3d.load_config({"tokens": {}})
    with pytest.raises(TypeError, match=r"write \['parallelism.dp=2'\]"):
        mesh3d.load_config(CONFIG, "parallelism.dp=2")
    with pytest.raises(TypeError, match=r"write \['parallelism.dp=2'\]"):
        mesh3d.apply_overrides(mesh3d.load_config(CONFIG), "parallelism.dp=2")
    with pytest.raises(TypeError, match=r"for a file: mesh3d.load_config\(path, overrides\)"):
        mesh3d.apply_overrides(str(CONFIG), ["parallelism.dp=2"])
    cfg = mesh3d.load_config(CONFIG, ["parallelism.dp=1"])  # the right forms still work
    assert mesh3d.apply_overrides(cfg, ["parallelism.dp=2"]).parallelism.dp == 2


def test_apply_tp_wants_the_tp_axis():
    whole = types.SimpleNamespace(ndim=4)  # the 4-axis mesh instead of mesh["tp"]
    with pytest.raises(TypeError, match=r"the mesh's tp axis, mesh\['tp'\], not 4 axes"):
        mesh3d.apply_tp(nn.Linear(2, 2), whole, {})


def test_run_save_without_a_checkpoints_section_says_to_add_one():
    run = Run.__new__(Run)  # what Run.prepare(cfg) returns for a config without `checkpoints`
    run.cfg = types.SimpleNamespace(checkpoints=None)
    with pytest.raises(mesh3d.UserError, match="Run.save needs a `checkpoints` section"):
        run.save(10, consumed=10)


class _GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)
        self.h = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(4)})


@pytest.mark.parametrize(
    "kwargs,says",
    [(dict(first="wte"), "first/last 'wte': give a tuple of names"),
     (dict(first=("embed",)), "_GPT has no 'embed'"),
     (dict(blocks="layers"), "_GPT has no 'layers'"),
     (dict(stage_id=2), "stage_id 2 is not in 0..1"),
     (dict(layers=[0, 9]), r"layers \['9'\] are not among `h` \['0', '1', '2', '3'\]")],
)  # fmt: skip
def test_build_stage_names_a_wrong_argument_on_every_stage(kwargs, says):
    """A typo in `first` used to pass on the stage that keeps it and fail deep on the others."""
    args = dict(stage_id=0, num_stages=2, layers=[0, 1], blocks="h", first=("wte",),
                last=("head",)) | kwargs  # fmt: skip
    with pytest.raises(ValueError, match=says):
        mesh3d.build_stage(_GPT(), **args)
    stage = mesh3d.build_stage(_GPT(), 1, 2, [2, 3], blocks="h", first=("wte",), last=("head",))
    assert stage.wte is None and list(stage.h) == ["2", "3"]


def test_a_weight_the_checkpoint_lacks_is_not_only_called_incomplete(tmp_path):
    """`load_state` of a model with a parameter the checkpoint's model did not have."""
    from mesh3d.checkpoint.nanotron_weights import Param, read_param

    p = Param("extra.weight", ("extra.weight",), (4,), (4, 4), "replicated", 0)
    with pytest.raises(mesh3d.UserError) as e:
        read_param(tmp_path, p)
    assert ": a checkpoint of a model without extra.weight, or an incomplete one" in str(e.value)
