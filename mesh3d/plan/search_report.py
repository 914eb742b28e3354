"""`mesh3d plan --search`: the ranked table, the line saying why the first wins, `--json`,
`--write` (the best layout as a config file)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from mesh3d.config import save_config
from mesh3d.errors import ConfigError, UserError
from mesh3d.plan.hardware import Hardware, hardware_file, hardware_named
from mesh3d.plan.search import USABLE, Candidate, check_world, search, why_not

JSON_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "full_shard", "recompute",
               "micro_batch_size", "batch_accumulation", "schedule", "virtual_stages",
               "memory_gib", "fits", "step_time_s", "tokens_per_s_per_gpu", "mfu", "dominant",
               "parts")  # fmt: skip


def why_first(a: Candidate, b: Candidate) -> str:
    """One line: what makes `a` faster than `b` (the part of the step that differs most), or
    that they tie at the table's precision (`a` is then first in the search's order)."""
    memory = f"memory {a.memory_gib:.1f} vs {b.memory_gib:.1f} GiB"
    if f"{a.step_time_s:.4g}" == f"{b.step_time_s:.4g}":
        return (
            f"why: {a.label} ties {b.label} at {a.step_time_s:.4g} s/step; first in the "
            f"search's order; {memory}"
        )
    gap = {k: b.parts.get(k, 0.0) - a.parts.get(k, 0.0) for k in a.parts | b.parts}
    part = max(gap, key=gap.get)
    return (
        f"why: {a.label} beats {b.label} by {b.step_time_s - a.step_time_s:.3g} s/step, mostly "
        f"{part} ({a.parts.get(part, 0):.3g} s vs {b.parts.get(part, 0):.3g} s); {memory}"
    )


# Where the model is known to be optimistic: TorchTitan's published long-context runs with
# context parallelism 2-8 (8B and 405B, 64k-256k tokens) ran this much slower than predicted
# (`python benchmarks/plan_search.py --published`, held-out rows; docs/plan-search.md)
CP_OPTIMISTIC = (2, 1.16, 1.64)


def caution(fits: list[Candidate], hw: Hardware) -> str | None:
    """A line when the winner relies on what the model prices too low (CP >= 2 on a GPU
    profile), naming the best layout that does not, so the user can compare the two."""
    cp, low, high = CP_OPTIMISTIC
    if not fits or fits[0].cp < cp or hw.name == "cpu":
        return None
    other = next(((i, c) for i, c in enumerate(fits, 1) if c.cp < cp), None)
    alt = (
        f"the best layout with cp < {cp} is #{other[0]} {other[1].label}, "
        f"{other[1].step_time_s:.4g} s/step"
        if other
        else f"no layout with cp < {cp} fits"
    )
    return (
        f"caution: #1 uses cp {fits[0].cp}; published runs with cp {cp}-8 ran {low}-{high}x "
        f"slower than this model predicts (docs/plan-search.md); {alt}"
    )


def format_search(found: list[Candidate], hw: Hardware, world: int, top: int, secs: float) -> str:
    fits = [c for c in found if c.fits]
    cap = USABLE * hw.memory_gib
    lines = [
        f"mesh3d plan --search: {len(found)} valid layouts on {world} ranks of {hw.name}, "
        f"{len(fits)} fit in {cap:.1f} GiB ({USABLE:.0%} of {hw.memory_gib:.1f}); {secs:.1f} s",
        f"  {'#':>3}  {'layout':<58} {'GiB/rank':>9} {'step s':>9} {'tok/s/GPU':>10} "
        f"{'MFU':>6}  dominant",
    ]
    for i, c in enumerate(fits[:top], 1):
        lines.append(
            f"  {i:>3}  {c.label:<58} {c.memory_gib:>9.1f} {c.step_time_s:>9.4g} "
            f"{c.tokens_per_s_per_gpu:>10.1f} {c.mfu:>6.1%}  {c.dominant}"
        )
    if len(fits) > 1:
        lines.append(why_first(fits[0], fits[1]))
    if warn := caution(fits, hw):
        lines.append(warn)
    return "\n".join(lines) + "\n"


_FIX = "give a file path in a writable folder"


def check_writable(path: str) -> None:
    """Refuse a `--write` path before searching: a folder, or under a file or a read-only folder."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--write {path}: is a folder; {_FIX}")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"--write {path}: {parent} is not a writable folder; {_FIX}")


def kept_line(cfg, config: str | None) -> str:
    """What `--write` took from the config as it was: everything but the layout keys, with its
    defaults written out; what surprises (no checkpoints, synthetic data, the default run's
    data and checkpoints folder) named."""
    source = config or "the built-in default run"
    notes = []
    if cfg.checkpoints is None:
        notes.append("checkpoints: null (it has no checkpoints section: the run saves none)")
    elif config is None:
        notes.append(f"checkpoints_path: {cfg.checkpoints.checkpoints_path} (the default run's: "
                     "it resumes from that run's checkpoints; set another for a new run)")  # fmt: skip
    stages = cfg.data_stages or []
    if not stages or any(stage.data.dataset is None for stage in stages):
        notes.append(f"mesh3d.dummy_data: {cfg.mesh3d.dummy_data} (synthetic data, no dataset)")
    elif config is None:
        notes.append("the default run's data, prepared in its cache (MESH3D_CACHE)")
    named = f", including {' and '.join(notes)}" if notes else ""
    return f"the layout keys changed; the rest is {source} as given (defaults written out){named}"


def run_search(cfg, args) -> None:
    """The `--search` command: print, and `--write` the best layout's config."""
    world = args.world_size or (
        cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp
        * cfg.parallelism.context_parallel_size
    )  # fmt: skip
    check_world(world)
    if args.write:
        check_writable(args.write)
    hw = hardware_file(args.hardware_file) if args.hardware_file else None
    hw = hw or hardware_named(args.hardware, world)
    nodes_of = args.nodes_of or hw.gpus_per_node
    start = time.perf_counter()
    found = search(cfg, world, hw, nodes_of)
    secs = time.perf_counter() - start
    fits = [c for c in found if c.fits]
    if not fits:
        raise ConfigError(why_not(min(found, key=lambda c: c.memory_gib), hw))
    if args.write:
        try:
            save_config(fits[0].apply(cfg), args.write, derived=False)
        except OSError as e:
            raise UserError(f"--write {args.write}: cannot write it ({e.strerror}); {_FIX}") from e
    if args.json:
        rows = [{k: getattr(c, k) for k in JSON_FIELDS} | {"layout": c.label} for c in fits]
        out = {"world_size": world, "hardware": dataclasses.asdict(hw), "nodes_of": nodes_of,
               "valid": len(found), "seconds": secs, "caution": caution(fits, hw),
               "candidates": rows[: args.top]}  # fmt: skip
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
    else:
        sys.stdout.write(format_search(found, hw, world, args.top, secs))
        if args.write:
            sys.stdout.write(f"wrote {args.write}: {' '.join(fits[0].overrides())}\n")
            sys.stdout.write(kept_line(cfg, args.config) + "\n")
