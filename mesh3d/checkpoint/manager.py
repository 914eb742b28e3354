"""One owner for a run's saves, from the step's state to the bucket.

A save can start in several places: the initial save, an interval save, a stop signal, the
end of the run. A background save (`mesh3d.async_checkpoint`) can be committed by the step
loop's poll, or by a finish before the next save, before a step is judged, at a stop, at an
error or at the end. Every one of these routes ends in `_committed`, which does the work that
follows a commit, in order:
announce it -> the Hugging Face export (`mesh3d.hf_export`) -> queue its upload (`s3_upload`)
-> retention (`mesh3d.keep_last_checkpoints`; not unsent folders, nor `keeps()`) -> `after_commit`.
`name_latest` is the only way, after a commit, to point `latest.txt` at a step; the loss-spike
guard names a checkpoint through it once the next step is healthy, and the bucket's `latest.txt`
follows. `close` ends the run's saves: it commits or abandons a save still being written, then
waits for the uploads with a time limit of its own, outside any collective.

    ckpt = Checkpointer(cfg, mesh)
    ckpt.save(10, write, background=True)   # write(background) -> step folder | PendingSave
    ckpt.poll()                             # at each step boundary (every rank)
    ckpt.finish()                           # before the next save, a judged step, a stop
    ckpt.close(error=None)                  # the end: uploads waited for, report kept

Every method but `name_latest` and `close` is called on every rank at the same point. The work
after a commit runs on world rank 0; when the export fails, every rank raises the same
`CheckpointWriteError` (exit 5).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from mesh3d import extensions
from mesh3d.checkpoint.folder import write_latest
from mesh3d.checkpoint.retention import prune
from mesh3d.errors import CheckpointWriteError
from mesh3d.log import logger
from mesh3d.mesh import collective_timeout, share


@dataclass
class UploadReport:
    """What became of a run's uploads when it ended: the S3 prefix, the steps uploaded and
    verified, those whose upload failed (kept locally), and those still uploading when the
    wait ended."""

    s3_root: str
    uploaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)

    def line(self) -> str:
        """One line for the run's summary."""
        text = f"{len(self.uploaded)} uploaded to {self.s3_root}"
        if self.failed:
            text += f"; NOT uploaded (kept locally): steps {self.failed}"
        if self.unfinished:
            text += f"; still uploading when the run ended: steps {self.unfinished}"
        return text


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Checkpointer:
    """See the module doc. `mesh`: the run's (its groups get the checkpoint timeout while a
    background save is committed)."""

    def __init__(self, cfg, mesh=None):
        self.cfg, self.mesh = cfg, mesh
        self.root = Path(cfg.checkpoints.checkpoints_path) if cfg.checkpoints else None
        self.pending = None  # a background save still being written (`async_save.PendingSave`)
        self.uploads = None  # `s3_upload`'s background uploads (rank 0, `upload.Uploader`)
        self.report: UploadReport | None = None  # set by `close` when the run uploaded
        self.after_commit: list[Callable[[Path], None]] = []  # they must not raise
        self.keeps: Callable[[], set[int]] = set  # steps retention never deletes (jobs read them)

    # ------------------------------------------------------------------------------ saving

    def save(self, step: int, write: Callable[[bool], object],
             background: bool = False) -> None:  # fmt: skip
        """Save step `step` through `write(background)` (every rank), which returns the
        committed step folder, or the `PendingSave` of a background one; a save still in
        flight is committed first, so at most one is."""
        self.finish()
        out = write(background)
        if not isinstance(out, Path):  # a background save's `PendingSave`
            self.pending = out
            logger.info(
                f"Step {step}: {out.nbytes / 2**20:.1f} MiB copied, written in the background"
            )
        else:
            self._committed(Path(out), announce=False)  # `save_checkpoint` announced it

    def poll(self) -> None:
        """At a step boundary: commit the background save if every rank has written it. A
        failed write raises here (every rank), the previous checkpoint intact."""
        if self.pending is not None and self.pending.poll():
            self._done_pending()

    def finish(self) -> None:
        """Wait for the background save, if any, and commit it (every rank)."""
        if self.pending is None:
            return
        m = self.cfg.mesh3d
        with collective_timeout(self.mesh, m.checkpoint_timeout_s, m.collective_timeout_s):
            self.pending.finish()
        self._done_pending()

    def _done_pending(self) -> None:
        final, self.pending = self.pending.final, None
        self._committed(final)

    def _committed(self, final: Path, announce: bool = True) -> None:
        """What follows every commit (see the module doc); rank 0 works, every rank learns
        whether it went through."""
        if announce:
            logger.info(f"Saved checkpoint {final}")
        problem = None
        if _rank() == 0:
            try:
                self._export(final)
            except Exception as e:  # noqa: BLE001 - reported alike on every rank below
                problem = (f"mesh3d.hf_export: cannot write the Hugging Face model of {final} "
                           f"to {self.root / 'hf' / final.name}: {_one_line(e)}. The checkpoint "
                           "itself is complete; free the folder or set mesh3d.hf_export: false")  # fmt: skip
            self._upload(final)
            self._retain()
            for callback in self.after_commit:
                callback(final)
        problem = share(problem)  # world rank 0's
        if problem:
            raise CheckpointWriteError(problem)

    def _export(self, final: Path) -> None:
        setting = self.cfg.mesh3d.hf_export
        if setting if isinstance(setting, bool) else int(final.name) % setting == 0:
            out = extensions.load("hf_export").export_hf(final, self.root / "hf" / final.name)
            logger.info(f"Wrote the Hugging Face model {out}")

    def _upload(self, final: Path) -> None:
        s3 = self.cfg.s3_upload
        if s3 is None:
            return
        if self.uploads is None:
            upload = extensions.load("s3_upload")
            self.uploads = upload.Uploader(self.root, s3.upload_s3_path, upload.S5cmd.of(s3),
                                           s3.remove_after_upload)  # fmt: skip
        self.uploads.submit(final)

    def _retain(self) -> None:
        """Delete what `mesh3d.keep_last_checkpoints` does not keep, never a folder whose upload
        is queued, running or failed, nor one in `keeps()`."""
        m, up = self.cfg.mesh3d, self.uploads
        if not m.keep_last_checkpoints:
            return
        with up.lock if up else nullcontext():
            gone = prune(self.root, m.keep_last_checkpoints, m.keep_checkpoint_every,
                         self.keeps() | (up.unsent() if up else set()))  # fmt: skip
        if gone:
            logger.info(f"Deleted old checkpoints {gone} in {self.root} "
                        f"(mesh3d.keep_last_checkpoints={m.keep_last_checkpoints})")  # fmt: skip

    def name_latest(self, step_dir: Path) -> None:
        """Point `latest.txt` at the committed `step_dir` (world rank 0), and the bucket's
        `latest.txt` once its upload is verified."""
        if _rank() != 0:
            return
        write_latest(step_dir.parent, step_dir.name)
        if self.uploads is not None:
            self.uploads.point_latest(int(step_dir.name))

    # ------------------------------------------------------------------------------ the end

    def close(self, error: BaseException | None, wait_s: float) -> None:
        """End the run's saves. A background save is committed when every rank stops at the
        same point (`error` None, or raised alike on every rank), else abandoned (its
        temporary folder removed). Then rank 0 waits up to `wait_s` for the uploads, never
        inside a collective, and logs what was not uploaded (`report`)."""
        if self.pending is not None:
            if error is None or getattr(error, "same_on_every_rank", False):
                try:
                    self.finish()
                except Exception as e:  # noqa: BLE001 - the run is ending with its own error
                    logger.error(f"the background save could not be committed: {_one_line(e)}")
                    if error is None:
                        raise
            else:
                self._abandon()
        if self.uploads is not None:
            self._wait_uploads(wait_s)
            self._retain()  # the folders retention spared while they were uploading

    def _abandon(self) -> None:
        """A rank failed alone while a save was written: no agreement is possible, so the save
        is dropped (the previous checkpoint stays `latest`)."""
        pending, self.pending = self.pending, None
        pending.job.wait()
        if _rank() == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        logger.warning(f"the background save of {pending.final} was abandoned: this run "
                       "stopped on an error before every rank could agree on it")  # fmt: skip

    def _wait_uploads(self, wait_s: float) -> None:
        up = self.uploads
        start = time.monotonic()
        failed, unfinished = up.close(timeout=wait_s)
        self.report = UploadReport(up.s3_root, up.verified(), sorted(failed), unfinished)
        if failed:
            logger.error(f"s3_upload: {len(failed)} checkpoint(s) not uploaded, kept in "
                         f"{self.root}: steps {sorted(failed)}")  # fmt: skip
        if unfinished:
            logger.error(f"s3_upload: still uploading after {time.monotonic() - start:.0f} s, "
                         f"the run ends without them (kept in {self.root}): steps {unfinished}")  # fmt: skip


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
