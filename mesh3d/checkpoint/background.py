"""Asynchronous saves (`mesh3d.async_checkpoint`): the step's state copied now, written later.

A save has two halves. The first gathers what each rank writes (collectives: full tensors of
its parameters, optimizer state, scheduler, metadata) and must run on the training thread, at
the step boundary. The second turns that into files (serialize, write, fsync, checksum) and
needs nobody else. `SnapshotWriter` stands in for `FolderWriter` during the first half: every
write is recorded with a private copy of its tensors (on CUDA in pinned CPU memory), so training
may change its own tensors at once. `Background` then replays the record into the real
`FolderWriter` on a thread while the next steps run:

    snap = SnapshotWriter()
    write_rank(snap)                          # collectives; the training thread
    job = Background(snap, FolderWriter(tmp))
    ...                                        # training goes on
    job.done(), job.wait()                    # (problem, files) once written

`atomic.py` owns the protocol around it (who agrees, what is committed, when).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.finite import non_finite
from mesh3d.checkpoint.folder import FolderWriter
from mesh3d.errors import NonFiniteError
from mesh3d.torch_private import local_tensor


def live_storages(modules, optimizer) -> set[int]:
    """The storages training will change: parameters, gradients, optimizer state."""
    tensors = [p for m in modules for p in m.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]  # fmt: skip
    return {_storage(t) for t in tensors}


def _storage(t: torch.Tensor) -> int:
    local = local_tensor(t) if isinstance(t, DTensor) else t  # a DTensor's shard
    return local.untyped_storage().data_ptr()


def snapshot(obj, live: set[int] | None = None):
    """`obj` with the tensors inside (dicts, lists, tuples) that training may change replaced
    by a copy of their own (on CPU; pinned for CUDA tensors, whose copy lands later: see
    `_fence`): those whose storage is in `live`,
    or all of them when `live` is None. A tensor made for the save (a gathered full tensor, a
    fused matrix) is nobody else's and is kept as it is, not copied twice."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if _on_device(t):
            return _device_copy(t)
        if live is not None and _storage(t) not in live:
            return t
        return t.clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return {k: snapshot(v, live) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v, live) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v, live) for v in obj)
    return obj


def _on_device(t: torch.Tensor) -> bool:
    """Whether `t` is copied to the host asynchronously (a CUDA tensor)."""
    return t.device.type == "cuda"


def _device_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `t`, queued on this thread's current CUDA stream (not yet landed)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _fence():
    """An event recorded on this thread's current stream, after the copies it queued: the
    writer thread waits on it. Recorded here, on the training thread, because the current
    device (and so the current stream) is per thread: the writer thread's would be cuda:0's."""
    event = torch.cuda.Event()
    event.record()
    return event


class SnapshotWriter:
    """`FolderWriter`'s writing methods, recorded with snapshots instead of written.

    `checks_finite`: `write_rank_state` leaves the NaN/inf check to `replay` (off the training
    thread), which refuses a non-finite tensor naming its file, before writing it.

    Example:

        snap = SnapshotWriter(live_storages(parts.modules, optimizer))
        snap.save_torch("optimizer/x.pt", {"state": {0: {"exp_avg": t}}})   # t copied now
        snap.nbytes                                                          # bytes held
    """

    checks_finite = True

    def __init__(self, live: set[int] | None = None):
        self.live = live
        self.ops: list[tuple[str, tuple]] = []
        self.nbytes = 0
        self.files: dict[str, tuple[int, int]] = {}  # filled by the real writer, not here
        self.fences: list = []  # what `replay` waits on before reading a device copy

    def _record(self, method: str, *args) -> None:
        queued = any(_on_device(t) for t in _tensors(args))
        args = snapshot(args, self.live)
        if queued:
            self.fences.append(_fence())
        self.nbytes += _tensor_bytes(args)
        self.ops.append((method, args))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._record("write_bytes", rel, bytes(data))

    def write_text(self, rel: str, text: str) -> None:
        self._record("write_text", rel, text)

    def save_tensors(self, rel: str, tensors: dict, metadata: dict | None = None) -> None:
        self._record("save_tensors", rel, tensors, metadata)

    def save_torch(self, rel: str, obj) -> None:
        self._record("save_torch", rel, obj)

    def sync_dirs(self) -> None:
        self._record("sync_dirs")

    def replay(self, writer: FolderWriter) -> None:
        """Do the recorded writes into `writer` (in their order), then fsync its folders; the
        device-to-host copies are waited for first (their fences)."""
        for fence in self.fences:
            fence.synchronize()
        for method, args in self.ops:
            for t in _tensors(args):
                bad = non_finite(t)
                if bad:
                    raise NonFiniteError(
                        f"refusing to save: {args[0]} holds {bad} NaN/inf value(s) of "
                        f"{t.numel()}; the checkpoint was not written and latest.txt still "
                        "names the last finite one"
                    )
            getattr(writer, method)(*args)
        writer.sync_dirs()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _tensor_bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


class Background:
    """`job()` on a daemon thread; its exception kept for the training thread to raise.

    Example:

        job = Background(lambda: snap.replay(writer), name="save 10")
        job.done()      # finished (or failed) without waiting
        job.wait()      # None, or the exception the write raised
    """

    def __init__(self, job: Callable[[], None], name: str):
        self.error: BaseException | None = None
        self.cpu_s = 0.0  # CPU seconds the job took (its thread's), once done
        self._thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            start = time.thread_time()
            job()
            self.cpu_s = time.thread_time() - start
        except BaseException as e:  # noqa: BLE001 (handed to the training thread)
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self.error
