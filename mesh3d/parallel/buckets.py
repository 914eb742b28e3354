"""zero_stage 0's gradient sum over dp x cp, in buckets, overlapped with the last backward.

Parameters are cut into buckets of `model.ddp_bucket_cap_mb` in backward order. During a step's
last microbatch a hook marks a gradient final at its `n`-th accumulation, and a bucket whose
gradients are all final is all-reduced asynchronously:

    reducer = GradBuckets(params, group, cap_bytes=25 * 2**20)
    reducer.begin(microbatches)      # before the step's first backward
    ...backward of every microbatch (a pipeline schedule's too)...
    reducer.finish()                 # waits; every gradient is now the sum over `group`

Buckets launch strictly in order, so every rank issues the same collectives; a bucket whose
hooks did not all fire (zero-bubble weight gradients) is reduced in `finish`. Expert-parallel
slices are left out. The sum is exact: the flat all-reduce's additions, per element.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(p: torch.nn.Parameter) -> int:
    local = _local(p.detach())
    return local.numel() * local.element_size()


def cut(sizes: list[int], cap: int, kinds: list | None = None) -> list[list[int]]:
    """Buckets (lists of indices, in backward order) of at most `cap` bytes over items of `sizes`
    bytes in registration order. A larger item is a bucket of its own; `kinds` (e.g. dtypes)
    never share a bucket."""
    kinds = kinds or [None] * len(sizes)
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if buckets and size + sizes[i] <= cap and kinds[buckets[-1][0]] == kinds[i]:
            buckets[-1].append(i)
            size += sizes[i]
        else:
            buckets.append([i])
            size = sizes[i]
    return buckets


def buffer_bytes(sizes: list[int], cap: int, in_flight: int = 2) -> int:
    """The extra memory of `GradBuckets`: `in_flight` buffers of the largest bucket with more
    than one item (a lone item is summed in place)."""
    multi = [sum(sizes[i] for i in b) for b in cut(sizes, cap) if len(b) > 1]
    return in_flight * max(multi, default=0)


def bucket_params(params: list, cap_bytes: int) -> list[list]:
    """`params` in backward order cut into buckets (`cut`); one dtype per bucket."""
    sizes = [_bytes(p) for p in params]
    return [[params[i] for i in b] for b in cut(sizes, cap_bytes, [p.dtype for p in params])]


class GradBuckets:
    """The bucketed, overlapped gradient sum of the module doc for one group of parameters."""

    def __init__(self, params: list, group: dist.ProcessGroup, cap_bytes: int, in_flight: int = 2):
        self.group = group
        self.params = [p for p in params if getattr(p, "expert_shard", None) is None]
        self.buckets = bucket_params(self.params, cap_bytes)
        self.bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self.in_flight = max(1, in_flight)
        sizes = [_bytes(p) for p in self.params]
        self.buffer_bytes = buffer_bytes(sizes, cap_bytes, self.in_flight)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]
        self._armed = False
        self.launched_in_backward = 0  # buckets of the last step launched by hooks (tests, bench)

    def begin(self, microbatches: int) -> None:
        """Arm the hooks for a step of `microbatches` backward passes."""
        self._n = microbatches
        self._count = dict.fromkeys(map(id, self.params), 0)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._out: deque = deque()
        self._armed = dist.get_world_size(self.group) > 1
        self.launched_in_backward = 0

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        self._count[id(p)] += 1
        if self._count[id(p)] != self._n:
            return
        self._ready[self.bucket_of[id(p)]] += 1
        b = self.buckets
        while self._next < len(b) and self._ready[self._next] == len(b[self._next]):
            self._launch(self._next)
            self._next += 1
            self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        if len(self._out) >= self.in_flight:
            self._land()
        grads = []
        for p in self.buckets[b]:
            if p.grad is None:  # no gradient this step (an unused parameter): it sums zeros
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        if len(grads) == 1 and grads[0].is_contiguous():
            buf = grads[0]  # final already: summed in place, no buffer
        else:
            buf = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        self._out.append((grads, buf, work))

    def _land(self) -> None:
        grads, buf, work = self._out.popleft()
        work.wait()
        if buf is grads[0]:
            return
        for g, part in zip(grads, buf.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce what the hooks did not launch (in order), wait for everything, disarm."""
        if not self._armed:
            return
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        while self._out:
            self._land()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
