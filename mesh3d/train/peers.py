"""After a failed collective: which ranks did not arrive, from their heartbeats in the
rendezvous store (`mesh3d/train/watchdog.py` writes them). A *stopped* peer on this host gets
SIGKILL, since it ignores the launcher's SIGTERM and torchrun would wait out its shutdown timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

from mesh3d.errors import PeerError
from mesh3d.rendezvous import process_state


def _beats(dog) -> dict[int, dict]:
    store = dog._store
    return {r: json.loads(store.get(str(r))) for r in range(dog.world) if store.check([str(r)])}


def _read_beats(dog, deadline_s: float) -> dict[int, dict] | None:
    """Every rank's heartbeat, None when the store does not answer within `deadline_s`."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(_beats(dog)), daemon=True)
    reader.start()
    reader.join(deadline_s)
    return box[0] if box else None


def diagnose(dog, error: BaseException) -> PeerError:
    """A `PeerError` for the failed collective `error`, naming the ranks that did not come."""
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else type(error).__name__
    head = f"a collective failed at step {dog.step} ({dog.phase}): {first}."
    stale_after = 3 * dog.interval
    beats = _read_beats(dog, 2 * dog.interval + 2)
    deadline = time.time() + min(40.0, stale_after + dog.interval)
    while beats is not None and time.time() < deadline:
        now = time.time()
        if any(_silent(dog, b, now, stale_after) for r, b in beats.items() if r != dog.rank):
            break  # someone is gone or stopped: that is the answer
        time.sleep(dog.interval / 2)  # a peer on another host that just died: let it age
        beats = _read_beats(dog, 2 * dog.interval + 2)
    if beats is None:
        body = "The rendezvous store does not answer, so the other ranks cannot be named (the rank or agent hosting it may be stopped or dead)."
    else:
        body = _describe(dog, beats, stale_after)
    return PeerError(f"{head} {body} {dog.last_checkpoint()}".strip())


def _silent(dog, beat: dict, now: float, stale_after: float) -> str | None:
    """Why a peer cannot be answering, or None."""
    if beat["phase"] == "exited":
        return f"it ended its run: {beat.get('why') or 'no reason given'}"
    if beat["host"] == dog.host and process_state(beat["pid"]) in (None, "Z", "X"):
        return "its process is gone"
    if now - beat["time"] > stale_after:
        return "its heartbeat stopped (the process is stopped, dead, or hung in native code)"
    return None


def _describe(dog, beats: dict[int, dict], stale_after: float) -> str:
    now, parts, killed = time.time(), [], []
    missing = [r for r in range(dog.world) if r not in beats]
    silent = {r: why for r, b in beats.items() if r != dog.rank
              and (why := _silent(dog, b, now, stale_after))}  # fmt: skip
    behind = {r: b for r, b in beats.items()
              if r not in silent and r != dog.rank and b["step"] < dog.step}  # fmt: skip
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
        if b["host"] == dog.host and process_state(b["pid"]) in ("T", "t"):
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
