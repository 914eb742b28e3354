"""What a measuring rank records: when each compute action ran, and the bytes saved for backward.

Each action is timestamped by wrapping the `PipelineStage` methods every torch schedule calls for
compute (`forward_one_chunk`: F, `backward_one_chunk`: B, or I when called with
`full_backward=False`, `backward_weight_one_chunk`: W), with `time.perf_counter` (the system-wide
monotonic clock, so ranks share one time axis; CUDA is synchronized at both ends). The last
stage's loss runs inside its F (the loss function is wrapped too). Receives, sends and their waits
run between these calls, so they count as idle. Bytes saved for backward are metered with
`torch.autograd.graph.saved_tensors_hooks` (parameters left out), per stage and per rank, on the
warm-up step.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable

import torch

from schedules.sim import Event  # benchmarks/ is on sys.path (see __main__)


class _Held:
    """What the pack hook gives autograd: the tensor, and a weakref target that dies when
    autograd drops it (after the backward that used it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Bytes saved for backward alive at once, per stage and in all, with their peaks.

    The pack hook sees every tensor autograd saves; storages of parameters are left out, so what
    remains are activations. A storage counts once (by pointer) while any packed handle uses it;
    a weakref finalizer stops counting it when autograd drops the handle. Saved tensors are
    charged to the stage whose forward (or loss) is running (`self.stage`).
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = {self._storage(p).data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [handles, nbytes, stage]
        self.stage = -1
        self.now: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.total = self.total_peak = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.untyped_storage()

    def pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t.detach())  # no grad_fn: a saved output would hold its own node
        storage = self._storage(t)
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.params:
            return held
        entry = self.live.setdefault(key, [0, storage.nbytes(), self.stage])
        if entry[0] == 0:
            self._add(entry[2], entry[1])
        entry[0] += 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _add(self, stage: int, nbytes: int) -> None:
        self.now[stage] = self.now.get(stage, 0) + nbytes
        self.peak[stage] = max(self.peak.get(stage, 0), self.now[stage])
        self.total += nbytes
        self.total_peak = max(self.total_peak, self.total)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self._add(entry[2], -entry[1])
            del self.live[key]


class Recorder:
    """Timestamps of every compute action this rank runs (see the module docstring)."""

    def __init__(self, sync: bool):
        self.events: list[Event] = []
        self.sync = sync
        self.meter: SavedBytes | None = None

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, stage: int) -> float:
        if self.meter is not None:
            self.meter.stage = stage
        return self.now()

    def wrap_stage(self, stage) -> None:
        """Shadow the stage's compute methods with timed ones (instance attributes)."""
        idx = stage.stage_index
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight, signature = stage.backward_weight_one_chunk, inspect.signature(backward)

        def forward_one_chunk(chunk: int, *args, **kwargs):
            t0 = self._enter(idx)
            out = forward(chunk, *args, **kwargs)
            self.events.append(("F", idx, chunk, t0, self.now()))
            return out

        def backward_one_chunk(chunk: int, *args, **kwargs):
            full = signature.bind(chunk, *args, **kwargs).arguments.get("full_backward", True)
            t0 = self._enter(idx)
            out = backward(chunk, *args, **kwargs)
            self.events.append(("B" if full else "I", idx, chunk, t0, self.now()))
            return out

        def backward_weight_one_chunk(chunk: int, *args, **kwargs):
            t0 = self._enter(idx)
            out = weight(chunk, *args, **kwargs)
            self.events.append(("W", idx, chunk, t0, self.now()))
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def wrap_loss(self, loss_fn: Callable, last_stage: int) -> Callable:
        """The loss runs right after the last stage's forward: it extends that F."""

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            self._enter(last_stage)
            out = loss_fn(logits, labels)
            kind, s, mb, t0, _ = self.events[-1]
            assert (kind, s) == ("F", last_stage), self.events[-1]
            self.events[-1] = (kind, s, mb, t0, self.now())
            return out

        return loss
