"""zero_stage 0's gradient sum over dp x cp, in buckets, overlapped with the last backward.

The flat all-reduce (`data.allreduce_gradients`) waits for the whole backward and copies every
gradient into one buffer (a second full set of gradients at the peak). Here, as Nanotron and
DDP do, the parameters are cut into buckets of `model.ddp_bucket_cap_mb` in backward order
(the reverse of registration); during a step's last microbatch a hook counts each parameter's
gradient as final (its `n`-th accumulation of the step) and, as soon as a bucket's are all
final, launches that bucket's all-reduce asynchronously while the backward goes on:

    reducer = GradBuckets(params, group, cap_bytes=25 * 2**20)
    reducer.begin(microbatches)      # before the step's first backward
    ...backward of every microbatch (a pipeline schedule's too)...
    reducer.finish()                 # waits; every gradient is now the sum over `group`

Buckets are launched strictly in order (bucket k only after k-1), so every rank issues the same
collectives in the same order; a bucket whose hooks did not all fire (a zero-bubble schedule
computes weight gradients outside autograd's accumulation) is reduced in `finish`, still in
order. At most `in_flight` buckets are out at once: their buffers (`in_flight` x the largest
bucket; a bucket of one parameter is summed in place, without one) are the only extra memory,
which `mesh3d plan` counts (`buffer_bytes`). Expert-parallel slices are not replicated over dp
and are left out (`data.allreduce_param_grads` sums them over their own replicas). The sum is
exact: the same additions as the flat all-reduce, per element.
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
    """Buckets of at most `cap` bytes over items of `sizes` bytes given in registration order:
    lists of indices, in backward order (the reverse). An item larger than `cap` (or any item
    when `cap` is 0) is a bucket of its own; `kinds` (e.g. dtypes) never share a bucket."""
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
    """The extra memory of `GradBuckets` over items of `sizes` bytes: `in_flight` buffers of
    the largest bucket with more than one item (a lone item is summed in place)."""
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
        self.buffer_bytes = buffer_bytes(
            [_bytes(p) for p in self.params], cap_bytes, self.in_flight
        )
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
        key = id(p)
        self._count[key] += 1
        if self._count[key] != self._n:
            return
        self._ready[self.bucket_of[key]] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(
            self.buckets[self._next]
        ):
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
        flat, start = buf.view(-1), 0
        for g in grads:
            g.copy_(flat[start : start + g.numel()].view_as(g))
            start += g.numel()

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
