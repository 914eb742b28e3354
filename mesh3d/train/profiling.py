"""Nanotron's `profiler` section: global rank 0 writes a torch profiler trace of a few steps
into `profiler.profiler_export_path` as `<host>_<pid>.<time>.pt.trace.json`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _NoProfiler:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def step_profiler(args, rank: int) -> Iterator:
    """A context whose `.step()` is called once per training step (a no-op when off)."""
    if args is None or not args.profiler_export_path or rank != 0:
        yield _NoProfiler()
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=args.wait, warmup=args.warmup, active=args.active,
                                       repeat=args.repeat, skip_first=args.skip_first)  # fmt: skip
    with torch.profiler.profile(
        activities=activities, schedule=schedule,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profiler_export_path),
        record_shapes=args.record_shapes, profile_memory=args.profile_memory,
        with_stack=args.with_stack,
    ) as prof:  # fmt: skip
        yield prof
