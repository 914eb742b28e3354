"""Save and load any model (library use): `save_state` / `load_state` on the core of
`state.py`, each parameter one file named after it, its TP kind read off its DTensor placement
on the "tp" mesh dimension.

    mesh3d.save_state("ckpt/100", model, optimizer)       # every rank
    mesh3d.load_state("ckpt/100", model, optimizer)       # at any dp / tp / pp
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mesh3d import nanotron_names as names
from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.atomic import save_atomically
from mesh3d.checkpoint.folder import FolderWriter, damaged_error, verify
from mesh3d.checkpoint.nanotron_weights import Param
from mesh3d.checkpoint.state import Layout, held_parameters, write_rank_state
from mesh3d.errors import UserError


def _tp_kind(param: nn.Parameter) -> names.Kind:
    """'vocab' (split on dim 0), 'row' (dim 1) or 'replicated', from the "tp" placement."""
    if not isinstance(param, DTensor):
        return "replicated"
    dims = param.device_mesh.mesh_dim_names or ()
    if "tp" not in dims:
        return "replicated"
    placement = param.placements[dims.index("tp")]
    if isinstance(placement, Shard):
        if placement.dim == 0:
            return "vocab"  # one contiguous block of dim 0 per tp rank
        if placement.dim == 1:
            return "row"
        raise UserError(f"cannot save a parameter sharded on dim {placement.dim} over tp")
    return "replicated"


def params_of(
    modules: Iterable[nn.Module],
    name_map: Callable[[str], str] | dict[str, str] | None = None,
    pp_rank: int = 0,
) -> list[Param]:
    """One `Param` per parameter of `modules`: file name from `name_map` (default: the
    parameter's own name), full shape, TP kind from its placement, this rank's pp rank."""
    if isinstance(name_map, dict):
        mapping = name_map
        name_map = lambda n: mapping.get(n, n)  # noqa: E731
    out = []
    for name, group in held_parameters(modules).items():
        param = group[0]
        saved = name_map(name) if name_map else name
        shape = tuple(param.shape)
        if (shard := getattr(param, "expert_shard", None)) is not None:  # its rows of [E, ...]
            shape = (shape[0] * shard[2], *shape[1:])
        out.append(Param(saved, (name,), (shape[0],), shape, _tp_kind(param), pp_rank))
    return out


def _layout_of(mesh) -> Layout:
    if mesh is None:
        return Layout(1, 1, 1, {"pp": 0, "dp": 0, "cp": 0, "tp": 0})
    axes = ("pp", "dp", "cp", "tp")
    sizes = {n: mesh[n].size() if n in mesh.mesh_dim_names else 1 for n in axes}
    coords = {n: mesh[n].get_local_rank() if n in mesh.mesh_dim_names else 0 for n in sizes}
    return Layout(sizes["dp"], sizes["tp"], sizes["pp"], coords)


def save_state(
    path: str | Path,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh=None,
    name_map: Callable[[str], str] | dict[str, str] | None = None,
) -> Path:
    """Save a model (or this rank's pipeline stages) and its AdamW state in Nanotron's layout.

    Every rank calls it. `mesh` is the ("pp", "dp", "cp", "tp") DeviceMesh the model runs on, or
    a mesh with some of those axes (None: one process). `name_map` renames parameters in the files (e.g. to Nanotron's names). The
    folder is written as `.tmp-<name>` beside it, checksummed, and renamed into place when
    complete; a non-finite tensor or a write error raises on every rank and leaves `path` as it
    was. Weights are written in their own dtype; optimizer state as ZeRO-0 files. Returns `path`.

    Example:

        mesh3d.save_state("ckpt/100", model, optimizer, mesh=mesh)
    """
    path = Path(path)
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    layout = _layout_of(mesh)
    params = params_of(modules, name_map, layout.coords["pp"])

    def write_rank(writer: FolderWriter) -> None:
        write_rank_state(writer, params, held_parameters(modules), optimizer, layout, zero=False,
                         model_dtype=None, masters=False)  # fmt: skip

    def write_rank0(writer: FolderWriter) -> None:
        opt = nanotron_state.optimizer_config(
            "NamedOptimizer", layout.tp, layout.dp, layout.pp, [], False
        )
        writer.write_text("optimizer/optimizer_config.json", json.dumps(opt))
        meta = nanotron_state.metadata(
            layout.tp, layout.dp, 0, 0, [], {"writer": "mesh3d", "pp": layout.pp}
        )
        writer.write_text("checkpoint_metadata.json", json.dumps(meta, indent=2, sort_keys=True))

    return save_atomically(path, write_rank, write_rank0, latest=False)


def load_state(
    path: str | Path,
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    name_map: Callable[[str], str] | dict[str, str] | None = None,
) -> None:
    """Load what `save_state` wrote into a model built with the same TP plan, at any dp / tp /
    pp (no collectives). With `optimizer` (AdamW), its state is restored too.

    Example:

        mesh3d.load_state("ckpt/100", model, optimizer)
    """
    from mesh3d.checkpoint.load import load_rank_state, read_metadata

    path = Path(path)
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    read_metadata(path)
    problems = verify(path)
    if problems:
        raise damaged_error(path, problems)
    held = held_parameters(modules)
    params = [as_saved(path / "model", p) for p in params_of(modules, name_map)]
    load_rank_state(path, params, held, optimizer, optimizer is not None)


def as_saved(root: Path, p: Param) -> Param:
    """`p` with the TP kind its files were saved with, which the loading model's placement
    may not tell (saved split over tp, loaded at tp 1, or the other way round)."""
    *dirs, leaf = p.name.split(".")
    folder = root.joinpath(*dirs)
    if (folder / names.UNSHARDED_FILE.format(leaf=leaf)).is_file():
        return replace(p, kind="replicated")
    shards = sorted(folder.glob(f"model_{leaf}_pp-rank-*_tp-rank-*.safetensors"))
    if not shards:
        return p  # nothing saved: reading it names the missing file
    try:
        with safe_open(str(shards[0]), framework="pt") as f:
            local = tuple(f.get_slice(names.TENSOR_KEY).get_shape())
    except Exception:  # a damaged file: reading it names the problem
        return p
    split_rows = len(local) > 0 and local[0] != p.shape[0]
    return replace(p, kind="vocab" if split_rows or len(local) == 1 else "row")
