"""Asynchronous saves (`mesh3d.async_checkpoint`, loaded only when it is on): `atomic.py`'s
protocol with this rank's writing moved to a background thread.

    pending = start_save(final, write_rank, write_rank0, live=live_storages(modules, optimizer))
    ...                                    # training goes on
    pending.poll()                         # at each step boundary, every rank: True once committed
    pending.finish()                       # before the next save, a stop or the end

Step 1 and the collectives of step 2 run at the save (the state copied aside,
`background.SnapshotWriter`); steps 3-4 run on the training thread when `poll` or `finish` finds
every rank's write done, so the manifest, the rename and `latest.txt` happen as for a
synchronous save.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mesh3d.checkpoint.atomic import _agree, _attempt, _commit, _everyone, _prepare, _rank_world
from mesh3d.checkpoint.background import Background, SnapshotWriter, live_storages
from mesh3d.checkpoint.folder import FolderWriter

__all__ = ["PendingSave", "live_storages", "start_save"]


class PendingSave:
    """A save whose files are being written in the background (`start_save`).

    The training thread asks `poll()` at each step boundary (every rank, at the same point: it
    exchanges one flag) and `finish()` before the next save, a stop or the end. Whichever sees
    every rank's write done runs steps 3-4 of the protocol on the training thread, so the
    manifest, the rename and `latest.txt` happen as for a synchronous save; a failed write
    raises there, the previous checkpoint untouched.
    """

    def __init__(self, final: Path, tmp: Path, job: Background, writer: FolderWriter,
                 write_rank0, latest: bool, nbytes: int):  # fmt: skip
        self.final, self.tmp, self.job, self.writer = final, tmp, job, writer
        self.write_rank0, self.latest, self.nbytes = write_rank0, latest, nbytes

    def poll(self) -> bool:
        """Commit if every rank's write is done (True); False while any is still writing."""
        if not all(_everyone(self.job.done())):
            return False
        self.finish()
        return True

    def finish(self) -> Path:
        """Wait for this rank's write, then agree and commit (every rank calls it)."""
        error = self.job.wait()
        problem, own = (None, None) if error is None else _attempt(_reraise(error), self.tmp)
        reports = _agree(self.tmp, problem, own, self.writer.files)
        _commit(self.tmp, self.final, reports, self.write_rank0, self.latest)
        return self.final


def _reraise(error: BaseException) -> Callable[[], None]:
    def again() -> None:
        raise error

    return again


def start_save(
    final: Path,
    write_rank: Callable[[FolderWriter], None],
    write_rank0: Callable[[FolderWriter], None] | None = None,
    *,
    needed_bytes: int | None = None,
    needed_files: int = 0,
    step: int | None = None,
    latest: bool = True,
    live: set[int] | None = None,
) -> PendingSave:
    """`save_atomically`, with this rank's files written on a background thread: steps 1 and
    the collectives of 2 run now (the state copied aside, `background.SnapshotWriter`), the
    writing in the background, steps 3-4 when `PendingSave.poll`/`finish` find it done.
    `live` (`background.live_storages`): the storages training changes, the only tensors
    copied (None: every tensor). A failed copy is raised here on every rank; a non-finite
    tensor or a failed write when the save is committed."""
    tmp = _prepare(final, needed_bytes, needed_files, step)
    snap, snap0 = SnapshotWriter(live), SnapshotWriter(live)

    def record() -> None:
        write_rank(snap)
        if write_rank0 is not None and _rank_world()[0] == 0:
            write_rank0(snap0)  # the metadata of this step, not of the step that commits

    problem, own = _attempt(record, tmp)
    _agree(tmp, problem, own, {})  # a copy failed on some rank: every rank raises
    writer = FolderWriter(tmp)
    job = Background(lambda: snap.replay(writer), name=f"save {final.name}")
    return PendingSave(final, tmp, job, writer, snap0.replay if snap0.ops else None, latest,
                       snap.nbytes + snap0.nbytes)  # fmt: skip
