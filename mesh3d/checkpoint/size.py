"""How much one training checkpoint writes, for the free-space check before a save.

Counted from Nanotron's parameter table as `training.py` writes it: weights in the model dtype,
AdamW's two fp32 moments and the fp32 masters when kept, a tp-replicated parameter once per tp
rank, a tied embedding's optimizer state twice when the head is on another stage. Files: one
per parameter and tp (and ep) rank, the optimizer, scheduler and random-state files, a few
small ones, and a folder per parameter.
"""

from __future__ import annotations

import math

from mesh3d.checkpoint.nanotron_weights import nanotron_params
from mesh3d.layout import RunLayout

SMALL_FILES = 16  # config.yaml, metadata, model and optimizer configs, tokenizer, manifest


def checkpoint_size(cfg, layout: RunLayout) -> tuple[int, int]:
    """(data bytes, files and folders) of one checkpoint of a run (`layout`: its resolved
    layout, `cfg` for the optimizer), every rank's together."""
    par, opt = cfg.parallelism, cfg.optimizer
    shape = layout.shape
    params = nanotron_params(shape, par.pp)
    weight = layout.model_dtype.itemsize
    state = 8 if opt.optimizer_factory.name.lower() == "adamw" else 0
    if layout.fp32_masters:  # in the optimizer files (Nanotron's `gradient_accumulator`)
        state += 4
    data = 0
    for p in params:
        copies = par.tp if p.kind == "replicated" else 1
        data += math.prod(p.shape) * copies * (weight + state)
    if shape.tied and par.pp > 1:
        data += math.prod(params[0].shape) * state  # the head's copy of the embedding
    ep, cp = par.expert_parallel_size, max(par.context_parallel_size, 1)
    world = par.dp * cp * par.tp * par.pp
    optimizer_files = par.pp * par.tp * (par.dp * cp if opt.zero_stage > 0 else 1)
    files = len(params) * par.tp * ep + optimizer_files + par.pp * par.tp + world + SMALL_FILES
    return data, files + len(params) + SMALL_FILES
