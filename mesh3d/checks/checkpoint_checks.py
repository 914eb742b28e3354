"""Checks of the checkpoint settings of `mesh3d:` (asynchronous saves, retention); part of
`validate` (no torch import)."""

from __future__ import annotations

from collections.abc import Iterator

from mesh3d.config.schema import Config


def checkpoint_errors(cfg: Config) -> Iterator[str]:
    """`keep_last_checkpoints` >= 1, `keep_checkpoint_every` >= 1 and only beside it,
    `hf_export` a bool or >= 1; each of them and `async_checkpoint` need a `checkpoints`
    section."""
    m = cfg.mesh3d
    keep, every = m.keep_last_checkpoints, m.keep_checkpoint_every
    if keep is not None and keep < 1:
        yield (
            f"`mesh3d.keep_last_checkpoints` must be >= 1 (the newest step folders kept), got "
            f"{keep}; leave it null to keep every checkpoint"
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
