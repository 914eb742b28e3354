"""Which old step folders a run deletes: `mesh3d.keep_last_checkpoints` and
`mesh3d.keep_checkpoint_every` (default: keep all, as Nanotron).

    prune(Path("ckpt"), keep_last=3, keep_every=1000)   # -> the steps deleted, e.g. [200]

Runs on rank 0 right after a save committed. Never deleted: the step `latest.txt` names, the
last `keep_last` folders, every multiple of `keep_every`, the `protect`ed steps. A step's
`hf/<step>/` export goes with it. A folder is renamed to `.del-<step>` before it is removed,
so a crash mid-deletion leaves no half folder that looks like a checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mesh3d.checkpoint.folder import latest_step, step_folders


def kept(steps: list[int], latest: int | None, keep_last: int | None,
         keep_every: int | None) -> set[int]:  # fmt: skip
    """The steps of `steps` (sorted) that stay."""
    keep = set(steps[-keep_last:]) if keep_last else set(steps)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    if latest is not None:
        keep.add(latest)
    return keep


def prune(root: Path, keep_last: int | None, keep_every: int | None,
          protect: set[int] = frozenset()) -> list[int]:  # fmt: skip
    """Delete the step folders of `root` the settings do not keep; returns their steps."""
    for left in [*root.glob(".del-*"), *root.glob("hf/.del-*")]:
        shutil.rmtree(left, ignore_errors=True)
    if not keep_last:
        return []
    steps = step_folders(root)
    keep = kept(steps, latest_step(root), keep_last, keep_every) | set(protect)
    gone = [s for s in steps if s not in keep]
    for s in gone:
        for folder, doomed in ((root / str(s), root / f".del-{s}"),
                               (root / "hf" / str(s), root / "hf" / f".del-{s}")):  # fmt: skip
            if folder.is_dir():
                folder.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
    return gone
