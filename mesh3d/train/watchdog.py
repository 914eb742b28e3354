"""Each rank's watchdog: a daemon thread writes a heartbeat into the rendezvous store (read
after a failed collective to name the ranks that did not arrive), refreshes rank 0's folder
lock, and ends this rank when its launcher is gone (else it would train on alone)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from mesh3d.errors import PeerError
from mesh3d.torch_private import default_store

# what a failed collective says on gloo and NCCL (a timeout, or a peer that went away)
_COLLECTIVE_FAILURE = re.compile(
    r"gloo|nccl|timed out|connection (closed|reset)|broken pipe|DistBackendError|ProcessGroup",
    re.IGNORECASE,
)


def is_collective_failure(error: BaseException) -> bool:
    return isinstance(error, dist.DistError) or bool(_COLLECTIVE_FAILURE.search(str(error)))


def heartbeat_interval(collective_timeout_s: float) -> float:
    return max(0.2, min(10.0, collective_timeout_s / 5))


class Watchdog:
    """The heartbeat thread of one rank; the main thread sets `step` and `phase`. `lock`: the
    folder lock to refresh; `last_checkpoint()`: the sentence naming the checkpoint to resume.

    Example:

        with Watchdog(rank, world, interval=10.0, key="run-1") as dog:
            dog.at(5, "step")
            ...
            message = dog.diagnose(error)   # after a collective failed
    """

    def __init__(self, rank: int, world: int, interval: float, key: str, lock=None,
                 last_checkpoint: Callable[[], str] = str):  # fmt: skip
        self.rank, self.world, self.interval = rank, world, interval
        self.step, self.phase, self.why = 0, "start", None
        self.lock, self.last_checkpoint = lock, last_checkpoint
        self.host, self.pid, self.ppid = socket.gethostname(), os.getpid(), os.getppid()
        self._store = dist.PrefixStore(f"mesh3d/heartbeat/{key}", default_store())
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="mesh3d-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.interval + 1)

    def at(self, step: int, phase: str) -> None:
        """Where this rank is now; published by the thread (at most 20 times a second)."""
        self.step, self.phase = step, phase
        self._wake.set()

    def exited(self, why: str) -> None:
        """This rank's last heartbeat: it ends its run on purpose, and why."""
        self.phase, self.why = "exited", why[:200]
        with contextlib.suppress(Exception):  # the store may be gone as a job ends
            self._publish()

    def _publish(self) -> None:
        beat = {"step": self.step, "phase": self.phase, "host": self.host, "pid": self.pid,
                "time": time.time(), "why": self.why}  # fmt: skip
        self._store.set(str(self.rank), json.dumps(beat))

    def _run(self) -> None:
        refreshed = time.monotonic()
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self.ppid > 1 and os.getppid() != self.ppid:
                self._launcher_gone()
            with contextlib.suppress(Exception):  # the store may be gone as a job ends
                self._publish()
            if self.lock is not None and time.monotonic() - refreshed >= self.interval:
                self.lock.refresh()
                refreshed = time.monotonic()
            time.sleep(0.05)

    def _launcher_gone(self) -> None:
        message = (
            f"error: [rank {self.rank}] the launcher (pid {self.ppid}) is gone, so this rank "
            f"stops at step {self.step} ({self.phase}) instead of training on alone. "
            f"{self.last_checkpoint()}"
        )
        print(message, file=sys.stderr, flush=True)
        if self.lock is not None:
            self.lock.release()  # so that a restart can take the folder at once
        os._exit(PeerError.exit_code)

    def diagnose(self, error: BaseException) -> PeerError:
        """A `PeerError` for the failed collective `error`, naming the ranks that did not come
        (`mesh3d/train/peers.py`, loaded only after a collective failed)."""
        from mesh3d.train.peers import diagnose

        return diagnose(self, error)
