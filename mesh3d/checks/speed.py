"""Checks of the two speed switches of the `mesh3d:` section, `float8` and `async_tp`.

Part of `validate` (same rules: one message per problem, naming the key and the fix; no torch
import). What can only be known once torch runs (is there a GPU, is the group NCCL) is checked
again where the switch is applied: `mesh3d/train/float8.py`, `mesh3d/train/async_tp.py`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from mesh3d.config.schema import Config

TORCHAO_FIX = "`pip install torchao` (or `pip install mesh3d[float8]`), or set mesh3d.float8: false"
ASYNC_TP_NEEDS = "CUDA GPUs with NCCL (it runs on symmetric memory)"


def speed_errors(cfg: Config) -> Iterator[str]:
    """Every problem with `mesh3d.float8` and `mesh3d.async_tp` as set in `cfg`."""
    if cfg.mesh3d.float8:
        yield from _float8(cfg)
    if cfg.mesh3d.async_tp:
        yield from _async_tp(cfg)


def torchao_missing() -> bool:
    """Whether torchao cannot be imported (found without importing it, nor torch)."""
    return importlib.util.find_spec("torchao") is None


def _float8(cfg: Config) -> Iterator[str]:
    p = cfg.parallelism
    if torchao_missing():
        yield f"`mesh3d.float8: true` needs torchao, which is not installed: {TORCHAO_FIX}"
    if p.tp > 1:
        yield (
            f"`mesh3d.float8` does not work with `parallelism.tp` > 1 yet (tp is {p.tp}): mesh3d's "
            "tensor-parallel layers multiply local shards themselves and would bypass torchao's "
            "Float8Linear; set parallelism.tp: 1 (use dp or pp), or mesh3d.float8: false"
        )
    if p.expert_parallel_size > 1:
        yield (
            f"`mesh3d.float8` is not supported with `parallelism.expert_parallel_size` > 1 yet "
            f"(it is {p.expert_parallel_size}); set expert_parallel_size: 1, or mesh3d.float8: false"
        )


def _async_tp(cfg: Config) -> Iterator[str]:
    m, p = cfg.mesh3d, cfg.parallelism
    if not m.compile:
        yield (
            "`mesh3d.async_tp` rewrites torch.compile's graphs (inductor's micro-pipeline TP "
            "pass); set mesh3d.compile: true as well, or mesh3d.async_tp: false"
        )
    if p.tp <= 1:
        yield (
            f"`mesh3d.async_tp` overlaps tensor-parallel communication with matmuls, but "
            f"`parallelism.tp` is {p.tp}; set tp > 1, or mesh3d.async_tp: false"
        )
    elif p.tp_mode != "REDUCE_SCATTER":
        yield (
            f"`mesh3d.async_tp` needs `parallelism.tp_mode: REDUCE_SCATTER` (sequence parallel: "
            f"the all-gathers and reduce-scatters it overlaps); {p.tp_mode} has none of them. "
            "Set tp_mode: REDUCE_SCATTER, or mesh3d.async_tp: false"
        )
    if m.device == "cpu":
        yield (
            f"`mesh3d.async_tp` needs {ASYNC_TP_NEEDS}; mesh3d.device is cpu. Set "
            "mesh3d.device: cuda (or auto on GPUs), or mesh3d.async_tp: false"
        )
