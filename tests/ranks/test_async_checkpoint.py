"""Asynchronous saves (`mesh3d.async_checkpoint`) and retention (`mesh3d.keep_last_checkpoints`).

One 4-rank launch at dp2 x tp2 (zero 1): 6 steps saving every 2 synchronously; the same with
asynchronous saves and keep_last 2; a resume from the asynchronous step 4. The asynchronous
run trains exactly as the synchronous one, writes the same files (every tensor, state and text
equal), keeps only steps 4 and 6, and its step 4 resumes bitwise.

A second 2-rank launch breaks the background write: rank 1's write of step 4 fails (disk full)
— the run stops at the next step boundary with the save error on every rank, step 2 stays the
latest, complete checkpoint and no half folder is left; and a stop signal while a save is in
flight commits it first, then saves the stop step (exit 75's promise).
"""

import errno
import json
import os
import signal
import threading
import time

import torch
from dist import run_ranks
from parity import layout_overrides, train_runs
from safetensors import safe_open

import mesh3d.checkpoint.folder as folder
from mesh3d.checkpoint.retention import kept
from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import CheckpointWriteError, Preempted

ASYNC = ["mesh3d.async_checkpoint=true"]


def _ckpt(path, interval, steps, resume=None):
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={interval}",
           f"tokens.train_steps={steps}"]  # fmt: skip
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _files(step_dir):
    """Every file of the manifest, read: safetensors as (metadata, tensors), torch files loaded,
    the rest as bytes (safetensors' JSON header orders its metadata differently per process)."""
    out = {}
    for rel in json.loads((step_dir / "mesh3d_manifest.json").read_text())["files"]:
        path = step_dir / rel
        if rel.endswith(".safetensors"):
            with safe_open(path, "pt") as f:
                out[rel] = (f.metadata(), {k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        elif rel.endswith(".pt") and not rel.startswith("random/"):
            out[rel] = torch.load(path, weights_only=True)
        else:
            out[rel] = path.read_bytes()
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_async_saves_train_and_write_as_sync_ones_and_retention_keeps_the_last(tmp_path):
    four = layout_overrides(2, 2, "ALL_REDUCE", 1, False)
    runs = [
        four + _ckpt(tmp_path / "sync", 2, 6),
        four + _ckpt(tmp_path / "async", 2, 6) + ASYNC + ["mesh3d.keep_last_checkpoints=2"],
        four + _ckpt(tmp_path / "resumed", 100, 6, resume=tmp_path / "async" / "4") + ASYNC,
    ]
    sync, background, resumed = run_ranks(4, train_runs, runs, timeout=400)[0]
    assert background["loss"] == sync["loss"]  # training does not notice the saves
    assert background["grad_norm"] == sync["grad_norm"]
    kept_steps = sorted(p.name for p in (tmp_path / "async").iterdir() if p.name.isdigit())
    assert kept_steps == ["4", "6"], kept_steps  # 2 was deleted once 6 was complete
    assert (tmp_path / "async" / "latest.txt").read_text() == "6"
    assert not [p for p in (tmp_path / "async").iterdir() if p.name.startswith(".")]
    for step in ("4", "6"):
        ours, theirs = _files(tmp_path / "async" / step), _files(tmp_path / "sync" / step)
        assert ours.keys() == theirs.keys() and len(ours) > 20, step
        assert [rel for rel in ours if not _same(ours[rel], theirs[rel])] == [], step
    assert resumed["loss"] == sync["loss"][4:]  # bitwise
    assert resumed["grad_norm"] == sync["grad_norm"][4:]


def test_retention_keeps_latest_and_every_nth():
    steps = [100, 200, 300, 400, 500]
    assert kept(steps, 500, 2, None) == {400, 500}
    assert kept(steps, 300, 1, 200) == {200, 300, 400, 500}
    assert kept(steps, None, None, None) == set(steps)


def _broken_or_stopped(rank, world, tmp):
    """Rank function: (the error of a run whose rank-1 background write fails, the outcome of
    a run stopped by SIGTERM while its step-4 save is being written)."""
    from parity import TINY

    from mesh3d.train.loop import train

    base = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ASYNC
    real = folder.FolderWriter.save_torch
    main = threading.main_thread()

    def full_disk(self, rel, obj):  # rank 1's background write of step 4 fails
        if threading.current_thread() is not main and ".tmp-4" in str(self.folder) and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.folder / rel))
        return real(self, rel, obj)

    folder.FolderWriter.save_torch = full_disk
    try:
        cfg = apply_overrides(config_from_dict(TINY), base + _ckpt(tmp / "full", 2, 8))
        train(cfg)
        broken = None
    except CheckpointWriteError as e:
        broken = str(e)
    finally:
        folder.FolderWriter.save_torch = real

    def slow(self, rel, obj):  # the step-4 write still runs when the stop arrives
        if threading.current_thread() is not main and ".tmp-4" in str(self.folder):
            time.sleep(1.0)
        return real(self, rel, obj)

    class StopAfter4:
        def on_step(self, run, step, out, metrics):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    folder.FolderWriter.save_torch = slow
    try:
        cfg = apply_overrides(config_from_dict(TINY), base + _ckpt(tmp / "stop", 4, 20))
        train(cfg, hooks=[StopAfter4()])
        stopped = None
    except Preempted as e:
        stopped = str(e)
    finally:
        folder.FolderWriter.save_torch = real
    return broken, stopped


def test_a_failed_background_write_stops_the_run_and_a_stop_waits_for_the_save(tmp_path):
    (broken, stopped), _ = run_ranks(2, _broken_or_stopped, tmp_path, timeout=300)
    assert broken is not None and "rank 1" in broken and "no space left" in broken, broken
    full = tmp_path / "full"
    assert (full / "latest.txt").read_text() == "2"
    assert sorted(
        p.name for p in full.iterdir() if p.name[0].isdigit() or p.name.startswith(".tmp")
    ) == ["2"]
    # the stop came at step 5's end, while step 4 was still being written in the background
    assert stopped is not None and "saved" in stopped, stopped
    stop = tmp_path / "stop"
    steps = sorted(int(p.name) for p in stop.iterdir() if p.name.isdigit())
    assert steps == [4, 5], steps
    assert (stop / "latest.txt").read_text() == "5"
    assert all((stop / str(s) / "mesh3d_manifest.json").is_file() for s in steps)
