"""Checks of the `profiler` schedule, `mesh3d.stream_shards`, `mesh3d.recompute` /
`recompute_every`, `mesh3d.dp_shard` (HSDP) and `mesh3d.full_shard` with a pipeline, loaded by
`validate` only for a config that sets one (no torch import)."""

from __future__ import annotations

from collections.abc import Iterator

from mesh3d.config.derive import effective_pp_schedule, global_batch_size
from mesh3d.config.schema import Config
from mesh3d.parallel.pipeline_layout import SCHEDULES

# torch.profiler.schedule's bounds: it asserts wait, warmup, repeat, skip_first >= 0, active > 0
PROFILER_SCHEDULE = {
    "wait": (0, "steps waited each cycle"),
    "warmup": (0, "warmup steps each cycle"),
    "active": (1, "steps recorded each cycle"),
    "repeat": (0, "cycles; 0 repeats until the run ends"),
    "skip_first": (0, "steps skipped before the first cycle"),
}


RECOMPUTE_MODES = ("none", "full", "selective")


def run_errors(cfg: Config) -> Iterator[str]:
    """The profiler schedule's bounds, the stream's shards, the recompute keys, HSDP's groups,
    full_shard's schedules."""
    if cfg.profiler is not None:
        for key, (least, what) in PROFILER_SCHEDULE.items():
            value = getattr(cfg.profiler, key)
            if value < least:
                yield f"`profiler.{key}` must be >= {least} ({what}; torch.profiler.schedule's bound), got {value}"
    yield from _stream_shards(cfg)
    yield from _recompute(cfg)
    yield from _dp_shard(cfg)
    sched = effective_pp_schedule(cfg)
    zero_bubble = getattr(SCHEDULES.get(sched), "zero_bubble", False)  # (a bad name: _pipeline)
    if cfg.mesh3d.full_shard and cfg.parallelism.pp > 1 and zero_bubble:
        yield (
            f"`mesh3d.full_shard` with the {sched} pipeline schedule gives wrong gradients on torch "
            "(parameters resharded between the input- and weight-gradient passes); use "
            "optimizer.zero_stage: 1 with mesh3d.full_shard: false, or another schedule"
        )


def _stream_shards(cfg: Config) -> Iterator[str]:
    """A streamed stage's logical shards: >= 1; streamed, a divisor of the global batch that dp
    divides (`data/streaming.py` refuses it there, after the process groups)."""
    shards, key = cfg.mesh3d.stream_shards, "mesh3d.stream_shards"
    if shards is None:
        return
    if shards < 1:
        yield f"`{key}` must be >= 1 (a streamed stage's logical shards; null: the global batch size), got {shards}"
        return
    gbs, dp = global_batch_size(cfg), cfg.parallelism.dp
    if cfg.mesh3d.hf_streaming and (gbs % shards or shards % dp):
        yield (
            f"`{key}` ({shards}) must divide the global batch size ({gbs}) and be divisible by "
            f"parallelism.dp ({dp}): each step takes the same number of samples from every "
            f"logical shard, and each dp rank owns whole shards; use e.g. {gbs} or null"
        )


def _recompute(cfg: Config) -> Iterator[str]:
    """`mesh3d.recompute` and `recompute_every` against `parallelism.recompute_layer`."""
    m, layer = cfg.mesh3d, cfg.parallelism.recompute_layer
    if m.recompute is not None and m.recompute not in RECOMPUTE_MODES:
        yield f"`mesh3d.recompute` {m.recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}"
    elif m.recompute == "none" and layer:
        yield (
            "`mesh3d.recompute` none contradicts `parallelism.recompute_layer: true`; drop one "
            "(recompute_layer alone means full)"
        )
    if m.recompute_every < 1:
        yield f"`mesh3d.recompute_every` must be >= 1 (1: every layer), got {m.recompute_every}"
    elif m.recompute_every > 1 and m.recompute in (None, "none") and not layer:
        yield (
            f"`mesh3d.recompute_every` {m.recompute_every} needs recompute on: set "
            "mesh3d.recompute (full or selective) or parallelism.recompute_layer: true"
        )


def _dp_shard(cfg: Config) -> Iterator[str]:
    """`mesh3d.dp_shard`: FSDP inside groups of that many dp ranks (HSDP)."""
    k, p = cfg.mesh3d.dp_shard, cfg.parallelism
    if k is None:
        return
    if not 1 <= k <= p.dp or p.dp % k:
        yield (
            f"`mesh3d.dp_shard` ({k}) must divide `parallelism.dp` ({p.dp}): FSDP shards inside "
            f"groups of dp_shard dp ranks, dp / dp_shard groups replicate; use a divisor of {p.dp}"
        )
    if p.expert_parallel_size > 1:
        yield (
            "`mesh3d.dp_shard` with `parallelism.expert_parallel_size` > 1 is not supported yet "
            "(experts split over dp beside HSDP's groups); drop one of them"
        )
