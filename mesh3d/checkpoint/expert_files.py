"""Expert stacks (MoE layers) saved split over expert-parallel ranks: Nanotron's `exp-rank` file
names, one file per ep rank (`parallelism.expert_parallel_size` > 1), written and read back."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from mesh3d import nanotron_names as names
from mesh3d.checkpoint.nanotron_weights import Param, _read_file
from mesh3d.errors import UserError


def expert_files(p: Param, ep: int, pp: int, tp: int) -> list[tuple[str, slice]]:
    """(path under `model/`, rows) of each ep rank's file of the expert stack `p` (ep > 1)."""
    *dirs, leaf = p.name.split(".")
    n = p.shape[0] // ep
    return [
        ("/".join([*dirs, names.EXPERT_FILE.format(leaf=leaf, pp_rank=p.pp_rank, pp=pp, tp_rank=0,
                                                    tp=tp, ep_rank=e, ep=ep)]),
         slice(e * n, (e + 1) * n))
        for e in range(ep)
    ]  # fmt: skip


def read_expert_files(root: Path, p: Param) -> Tensor | None:
    """An expert stack saved split over ep ranks, put back together; None if not saved so."""
    *dirs, leaf = p.name.split(".")
    folder = root.joinpath(*dirs)
    pattern = re.compile(names.EXPERT_FILE_REGEX.format(leaf=leaf))
    found = {}
    for f in folder.glob(f"model_{leaf}_*exp-rank-*.safetensors") if folder.is_dir() else []:
        m = pattern.fullmatch(f.name)
        if m:
            found[int(m.group(5))] = (int(m.group(6)), f)
    if not found:
        return None
    ep = next(iter(found.values()))[0]
    if sorted(found) != list(range(ep)):
        raise UserError(
            f"{folder}: expert files of {p.name} for exp-ranks {sorted(found)}, expected 0..{ep - 1}; "
            "the checkpoint is incomplete"
        )
    full = torch.cat([_read_file(found[e][1])[0] for e in range(ep)])
    if tuple(full.shape) != p.shape:
        raise UserError(f"{folder}: the expert files of {p.name} make {tuple(full.shape)}, "
                        f"but the model config gives {p.shape}")  # fmt: skip
    return full
