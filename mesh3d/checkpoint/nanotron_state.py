"""Nanotron's training-state files: optimizer, LR scheduler, random states, metadata.

Optimizer states are per TP rank, in the weight shards' local layout: a ZeRO-0 file holds each
parameter's `exp_avg` / `exp_avg_sq` / `step` under an integer index, `names` maps index ->
parameter name, `gradient_accumulator` holds the fp32 masters; a ZeRO-1 file holds each tensor
flattened and cut to its dp rank's `[start, end)`, the offsets in `optimizer_config.json`.
Files are read with `torch.load(weights_only=True, mmap=True)`: plain tensors only, paged in
when used.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mesh3d.checkpoint.nanotron_weights import Param, local_shape, unshard
from mesh3d.errors import UserError
from mesh3d.nanotron_names import MAX_READ_VERSION, WRITE_VERSION

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MASTER = "master"  # our key for the fp32 master weight (Nanotron's `gradient_accumulator`)

_OPT_RE = re.compile(
    r"optimizer_pp-(\d+)-of-(\d+)(?:_dp-(\d+)-of-(\d+))?_tp-(\d+)-of-(\d+)_exp-(\d+)-of-(\d+)\.pt"
)


def optimizer_file(pp_rank: int, pp: int, tp_rank: int, tp: int, dp_rank=None, dp=None) -> str:
    """`optimizer_pp-P-of-PP[_dp-D-of-DP]_tp-T-of-TP_exp-0-of-1.pt` (ZeRO-1 has the dp part)."""
    dp_part = "" if dp_rank is None else f"_dp-{dp_rank}-of-{dp}"
    return f"optimizer_pp-{pp_rank}-of-{pp}{dp_part}_tp-{tp_rank}-of-{tp}_exp-0-of-1.pt"


def lr_scheduler_file(pp_rank: int, pp: int, tp_rank: int, tp: int) -> str:
    """No dp part, as Nanotron writes it (docs/nanotron-layout.md#lr-scheduler-files)."""
    return f"lr_scheduler_pp-{pp_rank}-of-{pp}_tp-{tp_rank}-of-{tp}_exp-0-of-1.pt"


def random_file(tp_rank: int, tp: int, dp_rank: int, dp: int, pp_rank: int, pp: int) -> str:
    return f"tp-{tp_rank}-of-{tp}_dp-{dp_rank}-of-{dp}_pp-{pp_rank}-of-{pp}.pt"


def zero1_ranges(numel: int, dp: int) -> list[tuple[int, int]]:
    """Nanotron's ZeRO-1 split of a flattened tensor: ceil(n/dp) elements per dp rank, the last
    `dp*ceil(n/dp) - n` ranks one less (docs/nanotron-layout.md#optimizer-files)."""
    base = math.ceil(numel / dp)
    short = dp * base - numel
    out, start = [], 0
    for r in range(dp):
        size = base - 1 if r >= dp - short else base
        out.append((start, start + size))
        start += size
    return out


def optimizer_config(kind: str, tp: int, dp: int, pp: int, params: list[Param], zero: bool):
    """`optimizer/optimizer_config.json` content; numbers as strings, as Nanotron writes them."""
    configs: dict = {}
    if zero:
        offsets, shapes = {}, {}
        for p in params:
            shape = local_shape(p, tp)
            ranges = zero1_ranges(math.prod(shape), dp)
            offsets[p.name] = {str(r): [str(a), str(b)] for r, (a, b) in enumerate(ranges) if b > a}
            shapes[p.name] = [str(d) for d in shape]
        configs = {"param_name_to_dp_rank_offsets": offsets, "orig_param_shapes": shapes}
    parallelism = {"tp_size": str(tp), "dp_size": str(dp), "pp_size": str(pp),
                   "expert_parallel_size": "1"}  # fmt: skip
    return {"type": kind, "parallelism": parallelism, "configs": configs}


def tp_rank_entries(params: list[Param], tp_rank: int) -> list[Param]:
    """The parameters Nanotron's optimizer and LR-scheduler files of tp rank `tp_rank` list, in
    order: all but, off tp rank 0, the row-parallel linears' biases (Nanotron's
    `TensorParallelRowLinear` creates them on tp rank 0 only)."""
    kinds = {p.name: p.kind for p in params}
    row_bias = {n for n in kinds if n.endswith(".bias") and kinds.get(n[:-5] + ".weight") == "row"}
    return [p for p in params if tp_rank == 0 or p.name not in row_bias]


def optimizer_payload(entries: list[tuple[str, dict[str, Tensor]]], groups: list[dict]) -> dict:
    """The dict Nanotron `torch.save`s: state by index, one param group per parameter
    (`groups[i]`), names, and `gradient_accumulator` when any entry has a master."""
    state, names, masters = {}, {}, {}
    for i, (name, tensors) in enumerate(entries):
        names[i] = name
        adam = {k: v for k, v in tensors.items() if k != MASTER}
        if adam:
            state[i] = adam
        if MASTER in tensors:
            masters[name] = tensors[MASTER]
    param_groups = [{**g, "params": [i]} for i, g in enumerate(groups)]
    out = {"state": state, "param_groups": param_groups, "names": names}
    if masters:
        out["gradient_accumulator"] = masters
    return out


def lr_scheduler_state(peaks: list[float], current: list[float], last_epoch: int) -> dict:
    """The LambdaLR `state_dict` Nanotron saves: one entry per parameter in every list (its
    loader zips them with its lambdas, strict); `base_lrs` the peak lrs, `_last_lr` the current."""
    return {
        "base_lrs": list(peaks),
        "last_epoch": last_epoch,
        "_step_count": last_epoch + 1,
        "_is_initial": False,
        "_get_lr_called_within_step": False,
        "_last_lr": list(current),
        "lr_lambdas": [{}] * len(peaks),  # a functools.partial's empty __dict__ per group
    }


def safe_load(path: Path, what: str):
    """`torch.load` of plain tensors and containers only, memory-mapped; clear errors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise UserError(f"missing {what} file {path}; the checkpoint is incomplete") from None
    except Exception as e:  # weights_only refusals and damaged zip files raise several types
        raise UserError(
            f"cannot read {what} file {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}; "
            "the file is corrupted or holds more than plain tensors"
        ) from None


class OptimizerFiles:
    """Every optimizer file of a step folder, indexed by Nanotron parameter name; `full`
    rebuilds a full tensor from any (pp, dp, tp) layout and ZeRO stage."""

    def __init__(self, folder: Path):
        self.folder = folder
        config_path = folder / "optimizer_config.json"
        if not config_path.is_file():
            raise UserError(
                f"missing {config_path}: the checkpoint has no optimizer state; resume with "
                "checkpoints.load_optimizer: false to load the weights only"
            )
        config = json.loads(config_path.read_text())
        par = config.get("parallelism", {})
        self.tp, self.dp = int(par.get("tp_size", 1)), int(par.get("dp_size", 1))
        cfgs = config.get("configs") or {}
        self.offsets = cfgs.get("param_name_to_dp_rank_offsets")
        self.shapes = cfgs.get("orig_param_shapes", {})
        # name -> {(tp_rank, dp_rank): (payload, index)}
        self.where: dict[str, dict[tuple[int, int], tuple[dict, int]]] = {}
        files = sorted(folder.glob("optimizer_*.pt"))
        if not files:
            raise UserError(f"{folder} has no optimizer_*.pt files; the checkpoint is incomplete")
        for path in files:
            m = _OPT_RE.fullmatch(path.name)
            if not m:
                continue
            tp_rank, dp_rank = int(m.group(5)), int(m.group(3) or 0)
            payload = safe_load(path, "optimizer")
            for idx, name in payload.get("names", {}).items():
                self.where.setdefault(name, {})[(tp_rank, dp_rank)] = (payload, int(idx))
        self.has_master = any(
            "gradient_accumulator" in pl for d in self.where.values() for pl, _ in d.values()
        )

    def _local(self, p: Param, key: str, tp_rank: int) -> Tensor | None:
        """TP rank `tp_rank`'s tensor of state `key` (ZeRO-1 slices joined and reshaped)."""
        found = self.where.get(p.name)
        if not found:
            raise UserError(
                f"{self.folder} has no optimizer state for {p.name}; the checkpoint is "
                "incomplete or of another model"
            )
        slices = []
        for (t, d), (payload, idx) in sorted(found.items(), key=lambda kv: kv[0][1]):
            if t != tp_rank:
                continue
            if key == MASTER:
                value = payload.get("gradient_accumulator", {}).get(p.name)
            else:
                value = payload["state"].get(idx, {}).get(key)
            if value is None:
                return None
            slices.append((d, value))
        if not slices:
            raise UserError(f"{self.folder}: no optimizer file of tp rank {tp_rank} has {p.name}")
        if self.offsets is None:  # ZeRO-0: one file per (pp, tp)
            return slices[0][1]
        shape = tuple(int(x) for x in self.shapes[p.name])
        flat = torch.cat([v.reshape(-1) for _, v in slices])
        if flat.numel() != math.prod(shape):
            raise UserError(
                f"{self.folder}: ZeRO-1 slices of {p.name} hold {flat.numel()} elements, "
                f"expected {math.prod(shape)} (shape {shape}); a dp rank's file is missing"
            )
        return flat.view(shape)

    def full(self, p: Param, key: str) -> Tensor | None:
        """Full tensor of state `key` of `p`, or None when the files have no such state."""
        tp = 1 if p.kind == "replicated" else self.tp
        shards = {}
        for t in range(tp):
            local = self._local(p, key, t)
            if local is None:
                return None
            shards[t] = local
        return unshard(p, shards, tp)

    def step(self, p: Param) -> Tensor | None:
        """AdamW's step counter of `p` (the same on every shard)."""
        payload, idx = next(iter(self.where.get(p.name, {}).values()), (None, None))
        return None if payload is None else payload["state"].get(idx, {}).get("step")


def metadata(tp: int, dp: int, step: int, consumed: int, stages: list[dict], extra: dict,
             cp: int = 1) -> dict:  # fmt: skip
    """`checkpoint_metadata.json` (docs/nanotron-layout.md#metadata-files), with HEAD's fields
    but version 1.4 so CLASSIC loads it; mesh3d's own fields in `custom_metas`.
    `consumed_tokens_total` is null: HEAD would check a number against the stages' counts."""
    return {
        "cp": cp,
        "custom_metas": extra,
        "dp": dp,
        "metas": {
            "consumed_tokens_total": None,
            "consumed_train_samples": consumed,
            "data_stages": stages,
            "last_stage_idx": max(
                (i for i, s in enumerate(stages) if s["consumed_train_samples"]), default=0
            ),  # fmt: skip
            "last_train_step": step,
        },
        "tp": tp,
        "version": WRITE_VERSION,
    }


def read_metadata(step_dir: Path) -> dict:
    """The step's `checkpoint_metadata.json`, version- and field-checked: a `UserError` names
    any field mesh3d reads that has the wrong type or range."""
    path = step_dir / "checkpoint_metadata.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"missing {path}; not a complete checkpoint step folder") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}); restore it from a copy") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("metas"), dict):
        raise UserError(f"{path} has no `metas` object; not a checkpoint_metadata.json")
    try:
        version = tuple(int(x) for x in str(meta["version"]).split("."))
    except (KeyError, ValueError):
        raise UserError(
            f"{path}: `version` is missing or not like 1.4 (got {meta.get('version')!r})"
        ) from None
    if version > MAX_READ_VERSION:
        raise UserError(
            f"{path} is checkpoint version {meta['version']}, newer than the "
            f"{'.'.join(map(str, MAX_READ_VERSION))} mesh3d reads"
        )
    metas, custom = meta["metas"], meta.get("custom_metas")
    fields = [(meta, "", "tp", 1), (meta, "", "dp", 1), (metas, "metas.", "last_train_step", 0),
              (metas, "metas.", "consumed_train_samples", 0)]  # fmt: skip
    if isinstance(custom, dict) and "pp" in custom:
        fields.append((custom, "custom_metas.", "pp", 1))
    for where, prefix, key, low in fields:
        value = where.get(key)
        if type(value) is not int or value < low:
            shown = "missing" if key not in where else f"{value!r}"
            raise UserError(
                f"{path}: `{prefix}{key}` must be an integer >= {low}, got {shown}; the file was "
                "edited or damaged: restore it or fix that field"
            )
    return meta


def random_states() -> dict:
    """This process's RNG states as plain tensors and ints (loadable with weights_only)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {
        "torch_cpu": torch.get_rng_state(),
        "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64)},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def set_random_states(states: dict, path: Path | None = None) -> None:
    """Restore what `random_states` saved (from `path`, named in the error if it is damaged)."""
    try:
        torch.set_rng_state(states["torch_cpu"])
        if "torch_cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["torch_cuda"])
        py = states["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), None))
        n = states["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError, AttributeError) as e:
        raise UserError(
            f"random-state file {path} is damaged ({type(e).__name__}: {e}); delete it to "
            "resume with fresh random states (the data order does not depend on them)"
        ) from None
