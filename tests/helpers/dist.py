"""Run a function on N forked ranks that share a gloo process group: the multi-process harness.

    results = run_ranks(8, check, 3, timeout=60)  # check(rank, 8, 3) on every rank, in rank order

Put many checks into one launch: have `fn` return a dict of named results and assert on it in
the parent (a module-scoped fixture can share one launch between several tests).

Choices, each measured on the 2-core CPU machines:
- Ranks are forked from this process, which imported torch.distributed's heavy modules when this
  module was imported: an 8-rank launch starts in ~0.3 s, against 7-20 s for spawn or torchrun.
  So `fn`, its arguments and closures need not be picklable; return values must be.
- Every rank calls `torch.set_num_threads(1)` first: a forked rank that uses the intra-op pool the
  parent already ran hangs forever.
- Ranks meet through a `FileStore` in a fresh temporary folder, not a TCPStore: no port to race
  for, and no store-server thread in the parent while it forks (a rank forked while that thread
  held the resolver lock inside getnameinfo hung forever).
- Success is an explicit ("ok", result) message from each rank, not an exit code: a rank may abort
  in torch's exit-time teardown after it succeeded, so ranks end with `os._exit`.
- The first rank that raises (or dies) ends the launch within half a second: every rank is
  killed, with no wait for collective timeouts. A rank that raised stays alive until then, so its
  peers see no reset connections and the report leads with the real cause, in full; what the
  failure set off in other ranks follows, one line each. Past `timeout`, the ranks still running
  dump their Python stacks (faulthandler) into the error before they are killed. The
  process-group timeout is longer than `timeout`, so the harness, which shows those stacks,
  fires first.
- Each rank leads its own process group (killing it kills anything it started) and dies with
  the parent (PR_SET_PDEATHSIG), so an interrupted pytest leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

# Imported here, once, so that forked ranks find them loaded (each costs seconds per rank).
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401

_PG_TIMEOUT_MARGIN_S = 30.0  # the process-group timeout is the harness timeout plus this
_STACK_DUMP_WAIT_S = 0.5  # time given to hung ranks to write their stacks
_FAILURE_GRACE_S = 0.5  # after a first failure, time to gather what it set off in other ranks
_ERROR_LINGER_S = 60.0  # a failed rank waits this long to be killed (see _rank_main)
_EXIT_GRACE_S = 5.0  # time given to successful ranks to exit before they are killed


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 120, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked ranks; their results.

    Each rank has a gloo default process group and the torchrun environment (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The results come back in rank order.
    If a rank raises, dies, or has not finished `timeout` seconds after the start, every rank is
    killed and an AssertionError names the failing ranks with their tracebacks (or, for ranks that
    timed out, their Python stacks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="mesh3d-ranks-") as tmp:
        procs: list[multiprocessing.Process] = []
        try:
            conns, stack_files = _start(world_size, fn, args, kwargs, timeout, tmp, procs)
            results, failures, pending = _collect(procs, conns, time.monotonic() + timeout)
            if failures:
                raise AssertionError(_error_report(world_size, failures, pending))
            if pending:
                stacks = _dump_stacks(procs, pending, stack_files)
                raise AssertionError(_timeout_report(world_size, timeout, pending, stacks))
            _join(procs, _EXIT_GRACE_S)
            return [results[rank] for rank in range(world_size)]
        finally:
            for proc in procs:
                _kill(proc)


def _start(world_size, fn, args, kwargs, timeout, tmp, procs):
    """Fork the ranks (appended to `procs` as they start); their result pipes and stack files."""
    ctx = multiprocessing.get_context("fork")
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),  # for code that starts its own group; ours uses a file
    }
    store_path = os.path.join(tmp, "store")
    pg_timeout = timedelta(seconds=timeout + _PG_TIMEOUT_MARGIN_S)
    conns, stack_files = [], []
    for rank in range(world_size):
        stack_file = open(os.path.join(tmp, f"stack-{rank}.txt"), "w+")  # noqa: SIM115
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main,
            args=(rank, env, store_path, pg_timeout, stack_file, writer, fn, args, kwargs),
            name=f"rank{rank}",
        )
        proc.start()
        procs.append(proc)
        with contextlib.suppress(OSError):  # the rank may have set it already, or died
            os.setpgid(proc.pid, proc.pid)
        writer.close()  # the rank holds the only write end: EOF means it is gone
        stack_file.close()
        conns.append(reader)
        stack_files.append(stack_file.name)
    return conns, stack_files


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, env, store_path, pg_timeout, stack_file, conn, fn, args, kwargs) -> None:
    """Body of one forked rank. Never returns: it reports through `conn`, then `os._exit`s."""
    status, code = "err", 1
    try:
        torch.set_num_threads(1)  # first: the parent's intra-op pool does not survive a fork
        os.setpgid(0, 0)
        _die_with_parent()
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
        world_size = int(env["WORLD_SIZE"])
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(pg_timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout
        )
        result = fn(rank, world_size, *args, **kwargs)
        try:
            message = pickle.dumps(("ok", result))
            status, code = "ok", 0
        except Exception as e:
            message = pickle.dumps(
                ("err", f"the return value of rank {rank} cannot be pickled: {e!r}")
            )
    except BaseException:
        message = pickle.dumps(("err", traceback.format_exc()))
    try:
        conn.send_bytes(message)
        if status == "ok" and dist.is_initialized():
            dist.destroy_process_group()
        elif status == "err":
            # Stay alive until the parent kills us: exiting would reset our peers' connections,
            # and their errors would bury ours.
            time.sleep(_ERROR_LINGER_S)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """Have Linux SIGKILL this process when the parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def _collect(procs, conns: list[Connection], deadline: float):
    """Wait for every rank's message until `deadline`, or shortly after the first failure.

    Returns (results, failures, pending): rank -> result; rank -> error text, most likely cause
    first; ranks that had not finished.
    """
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in arrival order
    died: set[int] = set()
    pending = set(range(len(procs)))
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # Sentinels first: a rank's death is reported before the errors it causes in its peers.
        waiting = {procs[r].sentinel: r for r in pending} | {conns[r]: r for r in pending}
        for ready in wait(list(waiting), timeout=left):
            rank = waiting[ready]
            if rank not in pending:
                continue
            message = _read(conns[rank])
            if message is not None:
                status, value = message
                (results if status == "ok" else errors)[rank] = value
            elif procs[rank].is_alive():
                continue  # EOF seen before the exit: the sentinel follows
            else:
                errors[rank] = _died(procs[rank])
                died.add(rank)
            pending.discard(rank)
        if errors:  # gather what the first failure set off, then stop
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    # A rank that died without a traceback cannot be a peer's casualty: list it first.
    failures = {r: errors[r] for r in sorted(errors, key=lambda r: r not in died)}
    return results, failures, pending


def _read(conn: Connection):
    """The rank's (status, value) message, or None when there is none (yet, or ever)."""
    try:
        if not conn.poll():
            return None
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _died(proc: multiprocessing.Process) -> str:
    proc.join(1)
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"the process {how} before reporting a result (no Python traceback: a crash, os._exit or the OOM killer)"


def _error_report(world_size: int, failures: dict[int, str], pending: set[int]) -> str:
    first, *others = failures
    lines = [f"rank {first} of {world_size} failed:", failures[first].rstrip()]
    if others:
        lines += ["", "then (often a consequence of the first failure):"]
        lines += [f"  rank {r} failed: {_last_line(failures[r])}" for r in others]
    if pending:
        lines += ["", f"ranks {sorted(pending)} were still running; every rank was killed"]
    return "\n".join(lines)


def _last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1] if text.strip() else "(empty error)"


def _dump_stacks(procs, ranks: set[int], stack_files: list[str]) -> dict[int, str]:
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_WAIT_S)
    stacks = {}
    for rank in ranks:
        with open(stack_files[rank]) as f:
            stacks[rank] = f.read().strip() or "(no stack: the rank did not answer SIGUSR1)"
    return stacks


def _timeout_report(world_size: int, timeout: float, pending: set[int], stacks) -> str:
    done = sorted(set(range(world_size)) - pending)
    lines = [
        f"ranks {sorted(pending)} of {world_size} timed out: not finished after {timeout:g} s "
        f"(ranks {done} had finished); all ranks were killed. Python stacks at the timeout:"
    ]
    for rank in sorted(pending):
        lines += ["", f"--- rank {rank} ---", stacks[rank]]
    return "\n".join(lines)


def _join(procs, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def _kill(proc: multiprocessing.Process) -> None:
    """SIGKILL the rank and everything it started (its process group), then reap it."""
    if proc.pid is None:
        return
    running = proc.exitcode is None
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # also reaches what an exited rank left behind
    except (ProcessLookupError, PermissionError):
        if running:  # the rank had not made its own group yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    proc.join()
