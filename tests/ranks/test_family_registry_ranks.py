"""A model family is one place: a throwaway family made of a model class, a spec and one registry
line trains at tp 2 x pp 2 equal to one process, with its own config checks; nothing else in
mesh3d names it. And a spec cannot be built without the config checks.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_family_registry.py`."""

from __future__ import annotations

import copy

import test_family_registry
from dist import run_ranks
from parity import TINY
from test_family_registry import _toy_cfg

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.train.loop import train

# test_family_registry's fixture, requested here by name
toy_registered = test_family_registry.toy_registered


def _losses(rank, world, overrides, toy=True):
    cfg = _toy_cfg(*overrides) if toy else apply_overrides(
        config_from_dict(copy.deepcopy(TINY)), ["tokens.train_steps=3", *overrides])  # fmt: skip
    return [m["lm_loss"] for m in train(cfg).metrics]


def test_a_new_family_trains_at_tp_and_pp_like_one_process(toy_registered):
    (one,) = run_ranks(1, _losses, [])
    (llama,) = run_ranks(1, _losses, [], toy=False)
    assert abs(one[0] - llama[0]) > 1e-3  # the scale acts: it is another model
    layout = ["parallelism.tp=2", "parallelism.pp=2", "tokens.batch_accumulation_per_replica=4"]
    four = run_ranks(4, _losses, layout, timeout=180)
    last = four[-1]  # the metrics owner: the last stage
    assert len(last) == 3 and max(abs(a - b) / abs(b) for a, b in zip(last, one)) < 1e-5, (
        last,
        one,
    )
