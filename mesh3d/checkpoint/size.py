"""How much one training checkpoint writes, for the free-space check before a save.

Counted from Nanotron's parameter table, as `training.py` writes it: every parameter's weights
in the model dtype, AdamW's two fp32 moments and the fp32 masters when kept, a tp-replicated
parameter (the norms) once per tp rank (each tp rank's files hold it whole), a tied embedding's
optimizer state twice when the head sits on another stage. The files: one per parameter and tp
rank (and expert-parallel rank), the optimizer, scheduler and random-state files, and a few
small ones; a folder per parameter. `folder.check_free_space` adds one block and 4 KiB of
headers per file and folder: what the bytes alone left out (2.41 MiB estimated for a save that
took 2.62 MiB on disk, so a disk that could not hold it passed the check).
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
