"""One run per checkpoints folder: a lock file taken atomically when a run starts.

`<checkpoints_path>/mesh3d.lock` (run id, host, pid and its start time, run start) is created
complete (written beside, then hard-linked into place), refreshed by the owner's watchdog and
removed at the end. A stale lock is taken over with a warning: on this host only once its
process is gone (a live owner, even one stopped with SIGSTOP, is never stale); from another host
once not refreshed for `STALE_S` seconds (clocks must agree within seconds; a run suspended
longer finds its lock taken at its next save: `FolderLock.taken_by`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from pathlib import Path

from mesh3d.errors import UserError, unwritable
from mesh3d.log import logger

LOCK = "mesh3d.lock"
STALE_S = 60.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _who(owner: dict, *more: str) -> str:
    who = ", ".join(f"{k} {owner[k]}" for k in ("run_id", "host", "pid", *more) if k in owner)
    return who or "unreadable lock"


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux /proc), None where unknown:
    with the pid it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class FolderLock:
    """The lock of checkpoints folder `root` for run `run_id` (taken by world rank 0 only).

    Example:

        lock = FolderLock(Path("ckpt"), run_id="a1b2c3")
        lock.acquire()     # UserError naming the owner if another live run holds it
        ...
        lock.release()
    """

    def __init__(self, root: Path, run_id: str):
        self.root, self.run_id = Path(root), run_id
        self.path = self.root / LOCK
        self.held = False

    def _read(self) -> tuple[dict, float] | None:
        """(owner info, seconds since the last refresh), None if there is no lock."""
        try:
            age = time.time() - self.path.stat().st_mtime
            info = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            info = {}
        return (info if isinstance(info, dict) else {}), age

    def _stale(self, info: dict, age: float) -> str | None:
        """Why the lock is stale, or None when its owner may be alive (see the module doc)."""
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and isinstance(pid, int):
            if not _alive(pid):
                return f"its process {pid} on this host is gone"
            started = info.get("pid_start")
            if started is not None and start_ticks(pid) not in (None, started):
                return f"its process {pid} on this host is gone (the pid is another process's now)"
            return None  # alive here: stopped or slow, never stale
        if age > STALE_S:
            return f"it was not refreshed for {age:.0f} s (more than {STALE_S:.0f} s)"
        return None

    def acquire(self) -> None:
        info = {
            "run_id": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": start_ticks(os.getpid()),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        tmp = self.root / f".{LOCK}.{os.getpid()}.tmp"
        try:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(info))
            except OSError as e:
                raise unwritable("checkpoints.checkpoints_path", self.root, e) from None
            for _ in range(3):
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, self.path)  # atomic: fails if the lock exists
                    self.held = True
                    return
                found = self._read()
                if found is None:
                    continue  # released in between: try again
                owner, age = found
                why = self._stale(owner, age)
                if why is None:
                    raise UserError(self._held_message(owner, age))
                logger.warning(f"taking over the stale lock {self.path} of run "
                               f"{owner.get('run_id', '?')}: {why}")  # fmt: skip
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            raise UserError(f"could not take the lock {self.path}: another run keeps taking it")
        finally:
            with contextlib.suppress(OSError):  # also no folder at all
                tmp.unlink()

    def _held_message(self, owner: dict, age: float) -> str:
        return (
            f"checkpoints folder {self.root} is in use by another run ({_who(owner, 'started')}; "
            f"lock refreshed {age:.0f} s ago). Two runs must not share "
            "checkpoints.checkpoints_path: stop that run or choose another folder. If that run "
            "is dead, its lock is taken over once its process is gone (same host) or "
            f"{STALE_S:.0f} s after its last refresh (another host), or delete {self.path}"
        )

    def taken_by(self) -> str | None:
        """None while this run still owns its lock; else who has it now, in words."""
        found = self._read()
        if found is None:
            return f"nobody: {self.path} was deleted"
        owner = found[0]
        return None if owner.get("run_id") == self.run_id else f"another run ({_who(owner)})"

    def refresh(self) -> bool:
        """Mark the lock alive; False (and nothing touched) once it is no longer this run's."""
        if not self.held or self.taken_by() is not None:
            return False
        with contextlib.suppress(OSError):
            os.utime(self.path)
        return True

    def release(self) -> None:
        """Remove the lock if this run still owns it."""
        if not self.held:
            return
        self.held = False
        found = self._read()
        if found is not None and found[0].get("run_id") == self.run_id:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
