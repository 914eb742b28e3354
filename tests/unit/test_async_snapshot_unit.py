"""The background save's device copies (`checkpoint/background.py`), on a CPU stand-in.

On CUDA a snapshot queues device-to-host copies into pinned memory on the training thread's
current stream; the writer thread must wait for them before it reads (and checksums) the host
buffers. The wait used to be `torch.cuda.current_stream().synchronize()` on the writer thread,
whose current device is cuda:0 whatever the rank's: on every other GPU the writer could read
buffers the copies had not reached, and the CRCs, computed over the same bytes, would verify.
Now the training thread records a fence after its copies and `replay` waits on it. The stand-in
here makes every copy land 0.2 s late, from another thread, and records on which thread each
fence was made.
"""

import threading
import time

import torch

import mesh3d.checkpoint.background as background
from mesh3d.checkpoint.background import SnapshotWriter


class _LateCopies:
    """Copies that land `delay_s` after they are queued, and fences that wait for them."""

    def __init__(self, delay_s: float = 0.2):
        self.delay_s, self.threads, self.fenced_on = delay_s, [], []

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(t)
        source = t.clone()  # what the device holds now

        def land():
            time.sleep(self.delay_s)
            out.copy_(source)

        self.threads.append(threading.Thread(target=land))
        self.threads[-1].start()
        return out

    def fence(self):
        self.fenced_on.append(threading.current_thread())
        queued = list(self.threads)

        class Fence:
            def synchronize(self):
                for th in queued:
                    th.join()

        return Fence()


class _Files:
    """A writer that keeps what it was given (the values at write time)."""

    def __init__(self):
        self.saved = {}

    def save_tensors(self, rel, tensors, metadata=None):
        self.saved[rel] = {k: v.clone() for k, v in tensors.items()}

    def sync_dirs(self):
        pass


def test_the_writer_thread_waits_for_late_device_copies(monkeypatch):
    late = _LateCopies()
    monkeypatch.setattr(background, "_on_device", lambda t: True)
    monkeypatch.setattr(background, "_device_copy", late.copy)
    monkeypatch.setattr(background, "_fence", late.fence)
    weight = torch.arange(1.0, 7.0).reshape(2, 3)
    snap = SnapshotWriter()
    snap.save_tensors("model/w.safetensors", {"data": weight})
    assert late.fenced_on == [threading.main_thread()]  # where the copies were queued
    files = _Files()
    job = background.Background(lambda: snap.replay(files), name="save 1")
    assert job.wait() is None
    assert torch.equal(files.saved["model/w.safetensors"]["data"], weight)  # not the zeros


def test_without_device_tensors_no_fence_is_recorded():
    snap = SnapshotWriter()
    snap.save_tensors("model/w.safetensors", {"data": torch.ones(2)})
    assert snap.fences == []
