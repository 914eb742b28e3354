"""The collective protocol of one save, shared by training checkpoints and `save_state`.

1. rank 0 checks the free space and makes an empty `.tmp-<name>/`;
2. every rank writes its files through a `FolderWriter` (fsynced, checksummed);
3. every rank shares (its problem or None, its files' checksums): if any rank failed, rank 0
   removes `.tmp-<name>/` and every rank raises the same error, so no rank waits on a peer;
4. rank 0 writes its own files and the manifest, and commits (`folder.commit`).
A failed save leaves the checkpoints folder as it was. `async_save.start_save` runs step 2 on a
background thread and steps 3-4 later on the training thread.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from mesh3d.checkpoint.folder import (
    FolderWriter,
    check_free_space,
    commit,
    write_error,
    write_manifest,
)
from mesh3d.errors import CheckpointWriteError, NonFiniteError

_KINDS = {"CheckpointWriteError": CheckpointWriteError, "NonFiniteError": NonFiniteError}
Problem = tuple[str, str] | None  # (exception class name, message)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _attempt(fn: Callable[[], None], where: Path) -> tuple[Problem, BaseException | None]:
    """Run `fn`; its failure as a (kind, message) every rank can raise, and the exception."""
    try:
        fn()
        return None, None
    except (CheckpointWriteError, NonFiniteError) as e:
        return (type(e).__name__, str(e)), e
    except OSError as e:
        err = write_error(Path(e.filename or where), e, where.parent)
        return ("CheckpointWriteError", str(err)), err
    except Exception as e:  # a bug: every rank stops, this one with its traceback
        return ("RuntimeError", f"{type(e).__name__}: {e}"), e


def _everyone(value) -> list:
    _, world = _rank_world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _raise_first(problems: list[Problem], own: BaseException | None) -> None:
    rank, world = _rank_world()
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not failed:
        return
    if own is not None and problems[rank] is not None and problems[rank][0] == "RuntimeError":
        raise own  # this rank's own bug, with its traceback
    r, (kind, message) = failed[0]
    prefix = f"rank {r}: " if world > 1 else ""
    raise _KINDS.get(kind, RuntimeError)(prefix + message)


def _prepare(final: Path, needed_bytes: int | None, needed_files: int, step: int | None) -> Path:
    """Step 1 on rank 0 (free space, an empty `.tmp-<name>/`); every rank gets the outcome."""
    root, tmp = final.parent, final.parent / f".tmp-{final.name}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        if needed_bytes is not None:
            check_free_space(root, needed_bytes, step if step is not None else -1, needed_files)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    problem, own = _attempt(prepare, tmp) if _rank_world()[0] == 0 else (None, None)
    _raise_first(_everyone(problem), own)
    return tmp


def _agree(tmp: Path, problem: Problem, own: BaseException | None, files: dict) -> list:
    """Step 3: share every rank's (problem, files); on any problem all raise. The reports."""
    reports = _everyone((problem, files))
    problems = [p for p, _ in reports]
    if any(problems) and _rank_world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_first(problems, own)
    return reports


def _commit(tmp: Path, final: Path, reports: list, write_rank0, latest: bool) -> None:
    """Step 4: rank 0 writes its files and the manifest and commits; all learn the outcome."""
    problem, own = None, None
    if _rank_world()[0] == 0:

        def finish() -> None:
            files = {rel: v for _, f in reports for rel, v in f.items()}
            own_writer = FolderWriter(tmp)
            if write_rank0 is not None:
                write_rank0(own_writer)
            own_writer.sync_dirs()
            write_manifest(tmp, {**files, **own_writer.files})
            commit(tmp, final, latest=latest)

        problem, own = _attempt(finish, tmp)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _raise_first(_everyone(problem), own)


def save_atomically(final: Path, write_rank: Callable[[FolderWriter], None],
                    write_rank0: Callable[[FolderWriter], None] | None = None, *,
                    needed_bytes: int | None = None, needed_files: int = 0,
                    step: int | None = None, latest: bool = True) -> Path:  # fmt: skip
    """Write folder `final` on every rank as described in the module doc; returns `final`."""
    tmp = _prepare(final, needed_bytes, needed_files, step)
    writer = FolderWriter(tmp)

    def write() -> None:
        write_rank(writer)
        writer.sync_dirs()

    problem, own = _attempt(write, tmp)
    reports = _agree(tmp, problem, own, writer.files)
    _commit(tmp, final, reports, write_rank0, latest)
    return final
