"""The fault suite, part 1 (forked ranks, one process group): what a long run does when the
numbers, the checkpoints folder or the disk go wrong. Each test reproduces one row of the table
in docs/faults.md and asserts the message, and that nothing was lost or poisoned.

This file holds the tests of that subject that launch real processes; the others are in
`tests/ranks/test_faults_checkpoint.py`."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_faults_processes import _tmpfs_works


def test_disk_full_inside_torch_save_is_a_write_error(tmp_path):
    """A full disk while torch.save wrote the optimizer file: `RuntimeError ... unexpected
    pos` (torch's zip writer replaces the OSError), 6 tracebacks and exit 1. Now the
    CheckpointWriteError every other write gives: the file, the cause, the free space (exit 5)."""
    from mesh3d.checkpoint.folder import FolderWriter
    from mesh3d.errors import CheckpointWriteError

    state = {"state": {0: {"exp_avg": torch.ones(100_000)}}}
    writer = FolderWriter(tmp_path / ".tmp-4")
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, resource.RLIM_INFINITY))
    try:
        with pytest.raises(CheckpointWriteError) as err:
            writer.save_torch("optimizer/optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt", state)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        signal.signal(signal.SIGXFSZ, previous)
    assert str(err.value).startswith(
        f"cannot write {tmp_path}/.tmp-4/optimizer/optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt: "
        "File too large (errno 27;"
    )
    if not _tmpfs_works():
        return  # no small tmpfs here: the file-size limit above stands for a full disk
    disk = tmp_path / "disk"  # the same on a full tmpfs: ENOSPC
    disk.mkdir()
    code = ("import pathlib, torch; from mesh3d.checkpoint.folder import FolderWriter; "
            f"FolderWriter(pathlib.Path('{disk}/.tmp-4')).save_torch('o.pt', "
            "{'state': {0: {'exp_avg': torch.ones(100_000)}}})")  # fmt: skip
    script = f'mount -t tmpfs -o size=64k tmpfs {disk} && {sys.executable} -c "{code}"'
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})  # fmt: skip
    assert (
        f"CheckpointWriteError: cannot write {disk}/.tmp-4/o.pt: no space left on the device (errno 28;"
        in run.stderr
    ), run.stderr[-2000:]
