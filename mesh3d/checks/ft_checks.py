"""Checks of `mesh3d.fault_tolerance` (torchft replica groups); part of `validate` (no torch
import)."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator

from mesh3d.config.schema import Config

KEY = "mesh3d.fault_tolerance"
REPLICA_ENV = "MESH3D_REPLICA_ID"  # this job's replica group when the config leaves it null
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address
MAX_GROUPS = 10_000


def replica_id(cfg: Config) -> int | None:
    """This job's replica group: the config's `replica_id`, else $MESH3D_REPLICA_ID (None:
    neither, or not a whole number)."""
    ft = cfg.mesh3d.fault_tolerance
    if ft.replica_id is not None:
        return ft.replica_id
    text = os.environ.get(REPLICA_ENV, "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def lighthouse(cfg: Config) -> str | None:
    """The lighthouse address: the config's, else $TORCHFT_LIGHTHOUSE."""
    return cfg.mesh3d.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None


def fault_tolerance_errors(cfg: Config) -> Iterator[str]:
    """`replica_groups` in [1, MAX_GROUPS]; this job's `replica_id` known and in range; a
    lighthouse address; `min_replicas` in [1, replica_groups]; positive timeouts; torchft
    installed; map-style data (a stream's position is not handed over when a group heals)."""
    ft = cfg.mesh3d.fault_tolerance
    if ft is None:
        return
    g = ft.replica_groups
    if not 1 <= g <= MAX_GROUPS:
        yield f"`{KEY}.replica_groups` must be in [1, {MAX_GROUPS}], got {g}"
        return
    rid = replica_id(cfg)
    if rid is None:
        yield (
            f"`{KEY}.replica_id` is not set and ${REPLICA_ENV} is not a whole number: give each "
            f"replica group's job its index, e.g. {KEY}.replica_id=0 .. {g - 1}"
        )
    elif not 0 <= rid < g:
        yield (
            f"`{KEY}.replica_id` ({rid}) must be in [0, replica_groups - 1 = {g - 1}]: each of "
            f"the {g} jobs takes one index"
        )
    if lighthouse(cfg) is None:
        yield (
            f"`{KEY}.lighthouse` is not set and ${LIGHTHOUSE_ENV} is empty: start one with "
            f"`torchft_lighthouse --min_replicas 1` and give its address, e.g. "
            f"{KEY}.lighthouse=http://localhost:29510"
        )
    if not 1 <= ft.min_replicas <= g:
        yield (
            f"`{KEY}.min_replicas` ({ft.min_replicas}) must be in [1, replica_groups = {g}]: "
            "the groups a step needs to commit"
        )
    for name in ("quorum_timeout_s", "timeout_s"):
        value = getattr(ft, name)
        if not (math.isfinite(value) and value > 0):
            yield f"`{KEY}.{name}` must be a finite number of seconds > 0, got {value}"
    if cfg.mesh3d.hf_streaming:
        yield (
            f"`{KEY}` with `mesh3d.hf_streaming` is not supported yet (a healing group would "
            "need the stream's position from its peer); use map-style data (a Nanoset folder or "
            "an HF dataset without streaming)"
        )
    if cfg.doremi is not None:
        yield (
            f"`{KEY}` with a `doremi:` section is not supported yet (the proxy's domain weights "
            "would need the groups' excess losses); run DoReMi without fault tolerance"
        )
    if importlib.util.find_spec("torchft") is None:
        yield f"`{KEY}` needs torchft, which is not installed: pip install 'mesh3d[ft]'"
