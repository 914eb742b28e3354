"""A model family is one place: a throwaway family made of a model class, a spec and one registry
line trains at tp 2 x pp 2 equal to one process, with its own config checks; nothing else in
mesh3d names it. And a spec cannot be built without the config checks.

The tests of this subject that need a process group are in
`tests/ranks/test_family_registry_ranks.py`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from parity import TINY

from mesh3d.checks import validation_errors
from mesh3d.config import LlamaConfig, apply_overrides, config_from_dict
from mesh3d.models import registry
from mesh3d.models.llama import Llama
from mesh3d.models.llama_spec import LLAMA
from mesh3d.models.spec import ModelSpec


@dataclasses.dataclass
class ToyConfig(LlamaConfig):
    """A Llama whose logits are scaled: another family as far as mesh3d can tell."""

    logit_scale: float = 0.5


class Toy(Llama):  # the family's model file
    def forward(self, ids, positions=None):
        out = super().forward(ids, positions)
        return out * self.logit_scale if self.lm_head is not None else out  # a pipeline stage


def _build(mc, vocab_size=None, attention="auto"):
    model = Toy(mc, vocab_size=vocab_size, attention=attention)
    model.logit_scale = mc.logit_scale
    return model


def _toy_errors(cfg):
    yield from LLAMA.config_errors(cfg)
    if not cfg.model.model_config.logit_scale > 0:
        yield f"`model.model_config.logit_scale` must be > 0, got {cfg.model.model_config.logit_scale}"


TOY = dataclasses.replace(
    LLAMA, family="toy", config_class=ToyConfig, build=_build, config_errors=_toy_errors
)  # fmt: skip  (the family's spec)


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(registry.FAMILIES, "toy", (__name__, "TOY", "ToyConfig"))  # the line


def _toy_cfg(*overrides: str, scale: float = 0.5):
    cfg = apply_overrides(
        config_from_dict(copy.deepcopy(TINY)), ["tokens.train_steps=3", *overrides]
    )
    mc = cfg.model.model_config
    cfg.model.model_config = ToyConfig(**dataclasses.asdict(mc), logit_scale=scale)
    return cfg


def test_its_own_and_the_shared_checks_run(toy_registered):
    errors = validation_errors(_toy_cfg("parallelism.tp=3", scale=-1.0), world_size=3)
    assert any("logit_scale" in e and "-1.0" in e for e in errors), errors
    assert any("num_attention_heads" in e and "parallelism.tp" in e for e in errors), errors


def test_without_the_registry_line_it_is_refused_by_name():
    errors = validation_errors(_toy_cfg(), world_size=1)
    assert any("model family Toy is not supported" in e for e in errors), errors


def test_a_spec_without_config_checks_cannot_be_made():
    fields = {f.name: getattr(LLAMA, f.name) for f in dataclasses.fields(ModelSpec)}
    del fields["config_errors"]
    with pytest.raises(TypeError, match="config_errors"):
        ModelSpec(**fields)
