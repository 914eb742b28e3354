"""The background upload of committed step folders to S3 (`s3_upload`), on world rank 0.

    up = Uploader(Path("ckpt"), "s3://bucket/run", S5cmd.of(cfg.s3_upload), remove=True)
    up.submit(Path("ckpt/200"))    # right after step 200 committed; returns at once
    ...
    up.point_latest(200)           # latest.txt named it later (the loss-spike guard's settle)
    up.close(timeout=60)           # at the end of the run: waits for what is queued

One thread uploads one folder at a time (`s3.upload_step`: files, manifest, verified listing,
then latest.txt when the local latest.txt names it), in the order submitted; `point_latest`
queues the bucket's latest.txt behind the step's own upload, written only once that step is
verified there. An upload that fails is tried `ATTEMPTS` times, then reported on one line
(the folder, the S3 path, the cause) and tried again after the next save; its local folder is
never removed. With `remove_after_upload`, a verified folder is deleted locally, except the
one `latest.txt` names and any newer one (waiting for the loss-spike guard to name it): a restart always finds the newest checkpoint on disk (the older ones
are in the bucket; `checkpoints.resume_checkpoint_path: s3://...` downloads one). Retention
(`retention.prune`) takes `lock` and spares `unsent()`: the folders queued, being uploaded,
or whose upload failed. `UploadHook` is how a run's `Checkpointer` drives it (a commit hook,
`checkpoint/manager.py`): the uploader started at the first commit, on world rank 0.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from mesh3d.checkpoint.folder import latest_step
from mesh3d.checkpoint.s3 import S5cmd, upload_step, write_bucket_latest
from mesh3d.log import logger

ATTEMPTS = 3
BACKOFF_S = 2.0  # before the second attempt; doubled for each next one


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


class UploadHook:
    """`s3_upload` as a commit hook of the run's `Checkpointer` (called on world rank 0)."""

    def __init__(self, s3, root: Path):
        self.s3, self.root, self.uploads = s3, root, None

    def committed(self, final: Path) -> None:
        if self.uploads is None:
            s3 = self.s3
            self.uploads = Uploader(self.root, s3.upload_s3_path, S5cmd.of(s3),
                                    s3.remove_after_upload)  # fmt: skip
        self.uploads.submit(final)

    def spared(self) -> set[int]:
        return self.uploads.unsent() if self.uploads else set()

    @property
    def lock(self):
        return self.uploads.lock if self.uploads else nullcontext()

    def named_latest(self, step_dir: Path) -> None:
        if self.uploads is not None:
            self.uploads.point_latest(int(step_dir.name))

    def close(self, wait_s: float) -> UploadReport | None:
        """Wait up to `wait_s` for the queued uploads; log and report what was not uploaded."""
        up = self.uploads
        if up is None:
            return None
        start = time.monotonic()
        failed, unfinished = up.close(timeout=wait_s)
        if failed:
            logger.error(f"s3_upload: {len(failed)} checkpoint(s) not uploaded, kept in "
                         f"{self.root}: steps {sorted(failed)}")  # fmt: skip
        if unfinished:
            logger.error(f"s3_upload: still uploading after {time.monotonic() - start:.0f} s, "
                         f"the run ends without them (kept in {self.root}): steps {unfinished}")  # fmt: skip
        return UploadReport(up.s3_root, up.verified(), sorted(failed), unfinished)


class Uploader:
    """See the module doc."""

    def __init__(self, root: Path, s3_root: str, s5: S5cmd, remove: bool):
        self.root, self.s3_root, self.s5, self.remove = root, s3_root.rstrip("/"), s5, remove
        self.lock = threading.Lock()  # held while a step folder is deleted (here or retention)
        self._mu = threading.Lock()  # guards the sets below
        self._waiting: set[int] = set()  # queued or being uploaded
        self._failed: dict[int, str] = {}  # step -> the last error, kept locally
        self._uploaded: set[int] = set()  # verified in the bucket, still on disk
        self._verified: list[int] = []  # every step verified in the bucket by this uploader
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mesh3d-s3-upload", daemon=True)
        self._thread.start()

    def unsent(self) -> set[int]:
        """The steps retention must not delete: queued, uploading, or failed."""
        with self._mu:
            return self._waiting | set(self._failed)

    def failures(self) -> dict[int, str]:
        """Step -> why its upload failed (each also logged once)."""
        with self._mu:
            return dict(self._failed)

    def submit(self, step_dir: Path) -> None:
        """Queue `step_dir` (committed), and again every folder whose upload failed before."""
        with self._mu:
            again = [s for s in sorted(self._failed) if (self.root / str(s)).is_dir()]
            self._failed.clear()
            steps = [s for s in [*again, int(step_dir.name)] if s not in self._waiting]
            self._waiting.update(steps)
        for s in steps:
            self._queue.put(("upload", s))

    def point_latest(self, step: int) -> None:
        """Point the bucket's latest.txt at `step` once its upload (queued before) is verified."""
        self._queue.put(("latest", step))

    def verified(self) -> list[int]:
        """The steps this uploader verified in the bucket, in order."""
        with self._mu:
            return sorted(self._verified)

    def close(self, timeout: float | None = None) -> tuple[dict[int, str], list[int]]:
        """Wait for the queued uploads, `timeout` seconds at most (None: as long as they take):
        (the failures, step -> cause; the steps still queued or uploading)."""
        if self._thread.is_alive():
            with self._mu:
                pending = len(self._waiting)
            if pending:
                limit = f" (at most {timeout:.0f} s)" if timeout is not None else ""
                logger.info(f"Waiting for {pending} checkpoint upload(s) to {self.s3_root}{limit}")
            self._queue.put(None)
            self._thread.join(timeout)
        with self._mu:
            return dict(self._failed), sorted(self._waiting)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, step = item
            if kind == "latest":
                self._point_latest(step)
                continue
            error = self._upload(step)
            with self._mu:
                self._waiting.discard(step)
                if error is None:
                    self._uploaded.add(step)
                    self._verified.append(step)
                else:
                    self._failed[step] = error
            if error is None and self.remove:
                self._remove_uploaded()

    def _point_latest(self, step: int) -> None:
        with self._mu:
            verified = step in self._verified
        if not verified:
            return  # its upload failed: the bucket keeps naming an older, complete step
        try:
            write_bucket_latest(self.s5, self.s3_root, step)
        except Exception as e:  # noqa: BLE001 - reported, never raised
            logger.error(f"s3_upload: cannot point {self.s3_root}/latest.txt at step {step}: {e}")

    def _upload(self, step: int) -> str | None:
        """Upload step `step`, retrying; None, or the error line (logged)."""
        step_dir = self.root / str(step)
        error = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            if not step_dir.is_dir():
                return None  # deleted meanwhile (an overwrite): nothing to upload
            try:
                prefix = upload_step(self.s5, step_dir, self.s3_root,
                                     latest=latest_step(self.root) == step)  # fmt: skip
                logger.info(f"Uploaded checkpoint {step_dir} to {prefix} (verified)")
                return None
            except Exception as e:  # noqa: BLE001 - any failure is reported, never raised
                error = str(e)
        line = (f"s3_upload: {error} (after {ATTEMPTS} attempts); the local checkpoint "
                f"{step_dir} is kept and its upload is tried again after the next save")  # fmt: skip
        logger.error(line)
        return line

    def _remove_uploaded(self) -> None:
        """Delete the verified folders but the one latest.txt names."""
        with self.lock:
            latest = latest_step(self.root)
            with self._mu:
                doomed = sorted(s for s in self._uploaded if latest is not None and s < latest)
                self._uploaded -= set(doomed)
            for s in doomed:
                folder = self.root / str(s)
                if not folder.is_dir():
                    continue
                gone = self.root / f".del-{s}"
                folder.rename(gone)
                shutil.rmtree(gone, ignore_errors=True)
                logger.info(f"Removed {folder} (s3_upload.remove_after_upload: it is in "
                            f"{self.s3_root}/{s}, verified)")  # fmt: skip
