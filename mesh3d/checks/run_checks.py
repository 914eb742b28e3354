"""Checks of the `profiler` schedule and `mesh3d.stream_shards`, loaded by `validate` only for
a config that sets one (no torch import)."""

from __future__ import annotations

from collections.abc import Iterator

from mesh3d.config.derive import global_batch_size
from mesh3d.config.schema import Config

# torch.profiler.schedule's bounds: it asserts wait, warmup, repeat, skip_first >= 0, active > 0
PROFILER_SCHEDULE = {
    "wait": (0, "steps waited each cycle"),
    "warmup": (0, "warmup steps each cycle"),
    "active": (1, "steps recorded each cycle"),
    "repeat": (0, "cycles; 0 repeats until the run ends"),
    "skip_first": (0, "steps skipped before the first cycle"),
}


def run_errors(cfg: Config) -> Iterator[str]:
    """The profiler schedule's bounds, the stream's shards."""
    if cfg.profiler is not None:
        for key, (least, what) in PROFILER_SCHEDULE.items():
            value = getattr(cfg.profiler, key)
            if value < least:
                yield f"`profiler.{key}` must be >= {least} ({what}; torch.profiler.schedule's bound), got {value}"
    yield from _stream_shards(cfg)


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
