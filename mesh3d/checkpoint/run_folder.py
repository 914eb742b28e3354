"""Where a run starts, and who may write its checkpoints folder.

`claim_folder` (world rank 0, before anything is written) takes the folder's lock, repairs
what an interrupted save left, and decides where the run starts:

| `resume_checkpoint_path` | folder holds checkpoints | `mesh3d.existing_checkpoints` | start |
|---|---|---|---|
| null | no | any | fresh |
| null | yes | error (default) | refused: the message says how to resume or overwrite |
| null | yes | resume | from `latest.txt` |
| null | yes | overwrite | fresh; the old step folders are deleted (see below) |
| null | no | resume | fresh, with a notice |
| the checkpoints folder | no | any | fresh, with a notice (the first start of a requeued job) |
| a path in the folder | - | any | from it |
| another path | yes | error / resume | refused: the folder would mix two runs |
| another path | yes | overwrite | from it; the folder's old step folders are deleted |

`overwrite` deletes nothing here: the run deletes `Claim.stale_steps` (`clear_steps`) once the
checkpoint to resume from is loaded. An `s3://` path is first fetched (`s3.fetch_step`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mesh3d import extensions
from mesh3d.checkpoint.folder import LATEST, latest_step, recover, step_folders
from mesh3d.checkpoint.lock import FolderLock
from mesh3d.checkpoint.training import resolve_step_dir
from mesh3d.errors import UserError
from mesh3d.log import logger


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


@dataclass
class Claim:
    """What `claim_folder` decided: the lock (held), the checkpoint to resume from (None:
    fresh), the step folders `mesh3d.existing_checkpoints: overwrite` is to delete."""

    lock: FolderLock
    resume: str | None = None
    stale_steps: list[int] = field(default_factory=list)


def clear_steps(root: Path, steps: list[int]) -> None:
    """Delete the step folders `steps` of `root` and its latest.txt (`overwrite`)."""
    if not steps:
        return
    for step in steps:
        shutil.rmtree(root / str(step))
    (root / LATEST).unlink(missing_ok=True)
    logger.warning(
        f"mesh3d.existing_checkpoints=overwrite: deleted step folder(s) {steps} of {root}"
    )


def _steps_text(root: Path, steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    latest = latest_step(root)
    return f"step folder(s) {shown}" + (f" (latest.txt names {latest})" if latest else "")


def claim_folder(cfg, run_id: str) -> Claim:
    """Take the folder and decide where the run starts (see the module doc). World rank 0 only."""
    ck, mode = cfg.checkpoints, cfg.mesh3d.existing_checkpoints
    root = Path(ck.checkpoints_path)
    lock = FolderLock(root, run_id)
    lock.acquire()
    try:
        recover(root)
        steps = step_folders(root)
        resume = ck.resume_checkpoint_path
        if resume is not None and str(resume).startswith("s3://"):
            s3 = extensions.load("s3")
            resume = str(s3.fetch_step(s3.S5cmd.of(cfg.s3_upload), str(resume), root))
        if resume is None:
            if not steps:
                if mode == "resume":
                    logger.info(
                        f"mesh3d.existing_checkpoints=resume: no checkpoint in {root} yet: starting fresh"
                    )
                return Claim(lock)
            if mode == "resume":
                logger.info(f"mesh3d.existing_checkpoints=resume: resuming from {root}")
                return Claim(lock, str(root))
            if mode == "overwrite":
                return Claim(lock, None, steps)
            raise UserError(
                f"checkpoints.checkpoints_path {root} already holds {_steps_text(root, steps)} and "
                f"this run does not resume. To continue that run set "
                f"checkpoints.resume_checkpoint_path={root} (or mesh3d.existing_checkpoints=resume); "
                "to start over and delete them set mesh3d.existing_checkpoints=overwrite; or "
                "choose another checkpoints_path"
            )
        if _inside(Path(resume), root):
            if Path(resume).resolve() == root.resolve() and not steps:
                logger.info(f"no checkpoint in {root} yet: starting fresh")
                return Claim(lock)
            resolve_step_dir(resume)  # a typo is found now, before any model is built
            return Claim(lock, resume)
        if steps and mode != "overwrite":
            raise UserError(
                f"checkpoints.checkpoints_path {root} holds {_steps_text(root, steps)} of another "
                f"run, and this run resumes from {resume}: its checkpoints would mix with them. "
                "Choose an empty checkpoints_path, or set mesh3d.existing_checkpoints=overwrite "
                "to delete them"
            )
        resolve_step_dir(resume)
        return Claim(lock, resume, steps)
    except BaseException:
        lock.release()
        raise
