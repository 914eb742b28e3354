"""Nanotron's training-state files: optimizer, LR scheduler, random states, metadata.

Optimizer states are per TP rank, in the weight shards' local layout: a ZeRO-0 file holds each
parameter's `exp_avg` / `exp_avg_sq` / `step` under an integer index, `names` maps index ->
parameter name, `gradient_accumulator` holds the fp32 masters; a ZeRO-1 file holds each tensor
flattened and cut to its dp rank's `[start, end)`, the offsets in `optimizer_config.json`.
`load.py` reads them back with `torch.load(weights_only=True, mmap=True)`: plain tensors only,
paged in when used.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch import Tensor

from mesh3d.checkpoint.nanotron_weights import Param, local_shape
from mesh3d.nanotron_names import WRITE_VERSION

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MASTER = "master"  # our key for the fp32 master weight (Nanotron's `gradient_accumulator`)


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
    full = numel - dp * (base - 1)  # ranks below `full` hold `base` elements, the rest one less
    starts = [r * base - max(0, r - full) for r in range(dp + 1)]
    return list(zip(starts, starts[1:]))


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
    adam = {i: {k: v for k, v in t.items() if k != MASTER} for i, (_, t) in enumerate(entries)}
    out = {
        "state": {i: s for i, s in adam.items() if s},
        "param_groups": [{**g, "params": [i]} for i, g in enumerate(groups)],
        "names": {i: name for i, (name, _) in enumerate(entries)},
    }
    if masters := {name: t[MASTER] for name, t in entries if MASTER in t}:
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
