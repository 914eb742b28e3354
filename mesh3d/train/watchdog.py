"""Each rank's watchdog: a heartbeat other ranks can read, and a launcher that must stay alive.

A daemon thread writes `{step, phase, host, pid, time}` into the rendezvous store every
`interval` s. After a failed collective, `diagnose` names the ranks that did not arrive (heartbeat
stopped, or behind); a *stopped* peer on this host gets SIGKILL, since it ignores the launcher's
SIGTERM and torchrun would wait out its shutdown timeout. The thread also ends this rank (exit 4)
when its launcher is gone (else it would train on alone), and refreshes rank 0's folder lock."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from mesh3d.errors import PeerError
from mesh3d.rendezvous import process_state
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

    # ----------------------------------------------------------------------- after a failure

    def _beats(self) -> dict[int, dict]:
        store = self._store
        return {
            r: json.loads(store.get(str(r))) for r in range(self.world) if store.check([str(r)])
        }

    def _read_beats(self, deadline_s: float) -> dict[int, dict] | None:
        """Every rank's heartbeat, None when the store does not answer within `deadline_s`."""
        box: list = []
        reader = threading.Thread(target=lambda: box.append(self._beats()), daemon=True)
        reader.start()
        reader.join(deadline_s)
        return box[0] if box else None

    def diagnose(self, error: BaseException) -> PeerError:
        """A `PeerError` for the failed collective `error`, naming the ranks that did not come."""
        text = str(error).strip()
        first = text.splitlines()[0][:200] if text else type(error).__name__
        head = f"a collective failed at step {self.step} ({self.phase}): {first}."
        stale_after = 3 * self.interval
        beats = self._read_beats(2 * self.interval + 2)
        deadline = time.time() + min(40.0, stale_after + self.interval)
        while beats is not None and time.time() < deadline:
            now = time.time()
            if any(self._silent(b, now, stale_after) for r, b in beats.items() if r != self.rank):
                break  # someone is gone or stopped: that is the answer
            time.sleep(self.interval / 2)  # a peer on another host that just died: let it age
            beats = self._read_beats(2 * self.interval + 2)
        if beats is None:
            body = "The rendezvous store does not answer, so the other ranks cannot be named (the rank or agent hosting it may be stopped or dead)."
        else:
            body = self._describe(beats, stale_after)
        return PeerError(f"{head} {body} {self.last_checkpoint()}".strip())

    def _silent(self, beat: dict, now: float, stale_after: float) -> str | None:
        """Why a peer cannot be answering, or None."""
        if beat["phase"] == "exited":
            return f"it ended its run: {beat.get('why') or 'no reason given'}"
        if beat["host"] == self.host and process_state(beat["pid"]) in (None, "Z", "X"):
            return "its process is gone"
        if now - beat["time"] > stale_after:
            return "its heartbeat stopped (the process is stopped, dead, or hung in native code)"
        return None

    def _describe(self, beats: dict[int, dict], stale_after: float) -> str:
        now, parts, killed = time.time(), [], []
        missing = [r for r in range(self.world) if r not in beats]
        silent = {r: why for r, b in beats.items() if r != self.rank
                  and (why := self._silent(b, now, stale_after))}  # fmt: skip
        behind = {r: b for r, b in beats.items()
                  if r not in silent and r != self.rank and b["step"] < self.step}  # fmt: skip
        for r, why in sorted(silent.items()):
            b = beats[r]
            where = f"host {b['host']}, pid {b['pid']}"
            if b["phase"] == "exited":
                parts.append(f"rank {r} ({where}) at step {b['step']}: {why}")
                continue
            parts.append(
                f"rank {r} ({where}) last reported step {b['step']} ({b['phase']}) "
                f"{now - b['time']:.0f} s ago: {why}"
            )
            if b["host"] == self.host and process_state(b["pid"]) in ("T", "t"):
                with contextlib.suppress(OSError):
                    os.kill(b["pid"], signal.SIGKILL)
                    killed.append(f"rank {r} (pid {b['pid']})")
        for r, b in sorted(behind.items()):
            parts.append(f"rank {r} is alive but still at step {b['step']} ({b['phase']})")
        if missing:
            parts.append(f"rank(s) {', '.join(map(str, missing))} never reported")
        if not parts:
            return (
                "Every rank's heartbeat is fresh and at this step: the communication itself "
                "failed (network, backend), or a rank is hung inside a collective."
            )
        text = "Not arrived: " + "; ".join(parts) + "."
        if killed:
            text += f" Sent SIGKILL to the stopped {', '.join(killed)} on this host, which would ignore the launcher's SIGTERM."
        return text
