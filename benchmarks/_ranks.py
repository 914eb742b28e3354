"""Start a benchmark's ranks: `launch(world, fn, *args)` runs `fn(rank, world, *args)` on fresh
processes (fork + gloo on CPU, spawn + nccl on CUDA) and returns the results in rank order.

Benchmarks do not import from tests/; this is their own small launcher. Each rank uses one
intra-op thread (a forked rank sharing the parent's thread pool hangs), reports through a queue
and leaves with `os._exit` (no exit-time teardown). A rank that fails or dies, or a run past
`timeout`, raises in the parent, which then kills every rank.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# glibc mallopt options
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def mallopt(option: int, value: int) -> None:
    """Set a glibc malloc option in this process (and in ranks forked from it later)."""
    ctypes.CDLL(None).mallopt(option, value)


def keep_freed_memory() -> None:
    """Serve tensors up to 32 MiB from the heap and keep freed memory instead of returning it.

    glibc's default hands large freed blocks back to the OS, so the next step's tensors fault
    their pages in afresh: on this VM that costs milliseconds per action, unevenly across ranks.
    Reusing memory is what jemalloc / tcmalloc do (PyTorch's CPU tuning guide recommends them).
    """
    mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's largest value
    mallopt(M_TRIM_THRESHOLD, 2**30)


def _rank_main(rank: int, world: int, tmp: str, backend: str, setup, q, fn, args) -> None:
    torch.set_num_threads(1)  # first: a forked rank using the parent's thread pool hangs
    try:
        if setup is not None:
            setup()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        store = dist.FileStore(f"{tmp}/store", world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))  # fmt: skip
        result = fn(rank, world, *args)
        dist.destroy_process_group()
        q.put((rank, "ok", result))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()  # the message is in the pipe
        os._exit(0)


def launch(world: int, fn: Callable, *args, cuda: bool = False, timeout: float = 600,
           setup: Callable[[], None] | None = None) -> list:  # fmt: skip
    """`fn(rank, world, *args)` on `world` ranks; `setup()` runs first in each rank."""
    ctx = multiprocessing.get_context("spawn" if cuda else "fork")
    backend = "nccl" if cuda else "gloo"
    with tempfile.TemporaryDirectory(prefix="mesh3d-bench-") as tmp:
        q, results, deadline = ctx.Queue(), {}, time.monotonic() + timeout
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, tmp, backend, setup, q, fn, args))
            for r in range(world)
        ]
        try:
            for proc in procs:
                proc.start()
            while len(results) < world:
                try:
                    rank, status, value = q.get(timeout=1)
                except queue.Empty:
                    dead = {
                        r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                    }
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"ranks died (exit codes {dead}) or timed out") from None
                    continue
                if status != "ok":  # the others may wait in a collective: killed below
                    codes = {r: p.exitcode for r, p in enumerate(procs)}
                    raise RuntimeError(f"rank {rank} failed (exit codes {codes}):\n{value}")
                results[rank] = value
            return [results[r] for r in range(world)]
        finally:
            for proc in procs:
                proc.join(5 if len(results) == world else 0)
                if proc.is_alive():
                    proc.kill()
