"""One owner for a run's saves, from the step's state to the bucket.

Every save ends in `_committed`, which runs the commit hooks in order on world rank 0: the
Hugging Face export -> the upload -> retention -> what a capability adds. A hook has
`committed(step_dir)` and may have `spared()` (steps retention must not delete), `lock` (held
while retention deletes), `named_latest(step_dir)` and `close(wait_s)` (may return a report).
`name_latest` is the only way to point `latest.txt` at a step after its commit.

    ckpt = Checkpointer(cfg, mesh)
    ckpt.save(10, write, background=True)   # write(background) -> step folder | PendingSave
    ckpt.poll()                             # at each step boundary (every rank)
    ckpt.finish()                           # before the next save, a judged step, a stop
    ckpt.close(error=None)                  # the end: uploads waited for, report kept

Every method but `name_latest` and `close` is called on every rank at the same point. When a
hook fails with a `CheckpointWriteError`, the others still run and every rank raises it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch.distributed as dist

from mesh3d import extensions
from mesh3d.checkpoint.folder import write_latest
from mesh3d.checkpoint.retention import prune
from mesh3d.errors import CheckpointWriteError
from mesh3d.log import logger
from mesh3d.mesh import collective_timeout, share


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Checkpointer:
    """See the module doc. `mesh`: the run's (its groups get the checkpoint timeout while a
    background save is committed)."""

    def __init__(self, cfg, mesh=None):
        self.cfg, self.mesh = cfg, mesh
        self.root = Path(cfg.checkpoints.checkpoints_path) if cfg.checkpoints else None
        self.pending = None  # a background save still being written (`async_save.PendingSave`)
        self.hooks = commit_hooks(cfg, self.root) if self.root else []  # a capability appends
        self.report = None  # what a hook's `close` reported (`s3_upload`: its `UploadReport`)

    def save(self, step: int, write: Callable[[bool], object],
             background: bool = False) -> None:  # fmt: skip
        """Save step `step` through `write(background)` (every rank; see the module doc); a
        save in flight is committed first."""
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
        """At a step boundary: commit the background save if every rank has written it (a
        failed write raises here on every rank)."""
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
        """Rank 0 runs the hooks; every rank learns whether they went through."""
        if announce:
            logger.info(f"Saved checkpoint {final}")
        problem = None
        if _rank() == 0:
            for hook in self.hooks:
                try:
                    hook.committed(final)
                except CheckpointWriteError as e:  # reported alike on every rank below
                    problem = problem or str(e)
        if problem := share(problem):  # world rank 0's
            raise CheckpointWriteError(problem)

    def name_latest(self, step_dir: Path) -> None:
        """Point `latest.txt` at the committed `step_dir` (world rank 0), and tell the hooks."""
        if _rank() != 0:
            return
        write_latest(step_dir.parent, step_dir.name)
        for hook in self.hooks:
            if hasattr(hook, "named_latest"):
                hook.named_latest(step_dir)

    def close(self, error: BaseException | None, wait_s: float) -> None:
        """End the run's saves. A background save is committed when every rank stops at the
        same point (`error` None, or raised alike on every rank), else abandoned. Then the
        hooks close (uploads waited for up to `wait_s`, outside any collective)."""
        if self.pending is not None:
            if error is None or getattr(error, "same_on_every_rank", False):
                try:
                    self.finish()
                except Exception as e:  # noqa: BLE001 - the run is ending with its own error
                    logger.error(f"the background save could not be committed: {one_line(e)}")
                    if error is None:
                        raise
            else:
                self._abandon()
        closing = [h for h in self.hooks if hasattr(h, "close")] if _rank() == 0 else []
        for hook in closing:
            self.report = hook.close(wait_s) or self.report
        for hook in self.hooks if closing else ():  # what retention spared while uploading
            if isinstance(hook, Retention):
                hook.committed(None)

    def _abandon(self) -> None:
        """A rank failed alone while a save was written: no agreement is possible, so the save
        is dropped (the previous checkpoint stays `latest`)."""
        pending, self.pending = self.pending, None
        pending.job.wait()
        if _rank() == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        logger.warning(f"the background save of {pending.final} was abandoned: this run "
                       "stopped on an error before every rank could agree on it")  # fmt: skip


def commit_hooks(cfg, root: Path) -> list:
    """The commit hooks `cfg` asks for, in their order (see the module doc)."""
    m, hooks = cfg.mesh3d, []
    if m.hf_export:
        hooks.append(extensions.load("hf_export").ExportHook(m.hf_export, root))
    if cfg.s3_upload is not None:
        hooks.append(extensions.load("s3_upload").UploadHook(cfg.s3_upload, root))
    if m.keep_last_checkpoints:
        hooks.append(Retention(m.keep_last_checkpoints, m.keep_checkpoint_every, root, hooks))
    return hooks


class Retention:
    """`mesh3d.keep_last_checkpoints` as a commit hook (`retention.prune`): never deletes a
    step another hook of `hooks` spares, and deletes under their `lock`."""

    def __init__(self, keep_last: int, keep_every: int | None, root: Path, hooks: list):
        self.keep_last, self.keep_every, self.root, self.hooks = keep_last, keep_every, root, hooks

    def committed(self, final: Path | None) -> None:
        spared = set().union(*(h.spared() for h in self.hooks if hasattr(h, "spared")))
        locks = [h.lock for h in self.hooks if hasattr(h, "lock")]
        with locks[0] if locks else nullcontext():
            gone = prune(self.root, self.keep_last, self.keep_every, spared)
        if gone:
            logger.info(f"Deleted old checkpoints {gone} in {self.root} "
                        f"(mesh3d.keep_last_checkpoints={self.keep_last})")  # fmt: skip


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
