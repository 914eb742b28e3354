"""Expert parallelism: the experts of every MoE layer split over `expert_parallel_size` ranks.

Where the ranks come from. As in Nanotron (whose world size does not count ep) and TorchTitan,
expert parallelism borrows the dp axis: ep divides dp, and the dp ranks d with the same
d // ep form an ep group (dp rank d = edp · ep + ep_rank, ep innermost). Each rank of an ep
group holds E / ep experts (ep rank r: experts r·E/ep .. (r+1)·E/ep - 1) and its own data, as
any dp rank. The ranks holding the same experts (same ep rank: the "edp" ranks, times cp) are
their replicas: expert gradients are summed over them, the other parameters' over dp x cp as
before.

One MoE layer's forward, on each rank (dropless):
1. route its own tokens (the router is replicated);
2. sort the k·T routed slots by expert, and tell every ep peer how many rows it will get for
   each of its experts (an all-to-all of counts);
3. send the rows (an all-to-all with uneven splits; its backward is the reverse all-to-all);
4. run the local experts on what arrived, grouped by expert;
5. send the results back (the reverse all-to-all), weight them and add them to their tokens.

The expert weights are plain tensors holding the rank's slice of the full [E, ...] tensors;
`expert_shard` marks them (group, rank, size) for initialization, checkpoints (gathered to the
full tensor on save, sliced on load: any ep can read them) and the gradient norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's ep group and its place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def dispatch(self, experts_fn, flat: Tensor, chosen: Tensor, weights: Tensor, num_experts: int):
        """`dispatch_and_combine` over this group: what an MoE block calls (it imports nothing
        of the parallel code)."""
        return dispatch_and_combine(experts_fn, flat, chosen, weights, num_experts, self)


def summed_over(group: dist.ProcessGroup):
    """`f(t)`: all-reduce `t` (a sum) over `group` in place and return the group's size; what
    an MoE block calls for the load statistics of a sequence split over `group`."""

    def f(t: Tensor) -> int:
        dist.all_reduce(t, group=group)
        return dist.get_world_size(group)

    return f


def ep_groups(world: int, dims, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert replica groups) as global ranks, for `dims` (a `ParallelDims`).

    An ep group: the dp ranks of one (pp, cp, tp) place with the same dp_rank // ep. A replica
    group: the ranks holding the same experts, i.e. the same (pp, tp) place and dp_rank % ep,
    over every cp rank."""
    eps, replicas = {}, {}
    for rank in range(world):
        c = dims.coords(rank)
        eps.setdefault((c["pp"], c["cp"], c["tp"], c["dp"] // ep), []).append(rank)
        replicas.setdefault((c["pp"], c["tp"], c["dp"] % ep), []).append(rank)
    return list(eps.values()), list(replicas.values())


def new_groups(dims, ep: int) -> tuple[ExpertParallel, dist.ProcessGroup]:
    """This rank's `ExpertParallel` and expert-replica group (every rank creates every group,
    in the same order, as `new_group` requires)."""
    world, me = dist.get_world_size(), dist.get_rank()
    eps, replicas = ep_groups(world, dims, ep)
    mine_ep = mine_rep = None
    for ranks in eps:
        g = dist.new_group(ranks)
        if me in ranks:
            mine_ep = ExpertParallel(g, len(ranks), ranks.index(me))
    for ranks in replicas:
        g = dist.new_group(ranks)
        if me in ranks:
            mine_rep = g
    return mine_ep, mine_rep


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split `send` ways out, `recv` ways in; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    return _AllToAll.apply(x, send, recv, group)


def dispatch_and_combine(
    experts_fn, flat: Tensor, chosen: Tensor, weights: Tensor, num_experts: int, ep: ExpertParallel
) -> Tensor:
    """Σ over each token's k experts of weight · expert(token), the experts spread over `ep`.

    flat [T, h]; chosen, weights [T, k]; `experts_fn(rows, counts)` runs the local experts on
    rows grouped by local expert (counts [E / ep]: rows of each). Returns [T, h] in `flat`'s
    dtype."""
    t, k = chosen.shape
    local = num_experts // ep.size
    slot_expert = chosen.reshape(-1)
    order = torch.argsort(slot_expert, stable=True)  # slots grouped by expert, then by token
    token_of = order // k
    counts = torch.bincount(slot_expert, minlength=num_experts)  # [E], rows sent per expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep.group)  # [ep · local]: per source, expert
    send = counts.view(ep.size, local).sum(1).tolist()
    recv = recv_counts.view(ep.size, local).sum(1).tolist()
    rows = all_to_all(flat[token_of], send, recv, ep.group)
    row_expert = torch.arange(local, device=flat.device).repeat(ep.size)
    row_expert = row_expert.repeat_interleave(recv_counts)  # local expert of each arrived row
    by_expert = torch.argsort(row_expert, stable=True)  # arrived by source; run by expert
    ran = experts_fn(rows[by_expert], torch.bincount(row_expert, minlength=local))
    out_rows = torch.empty_like(rows).index_copy(0, by_expert, ran)  # in x's dtype
    back = all_to_all(out_rows, recv, send, ep.group)  # in `order`
    weighted = back * weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(flat).index_add(0, token_of, weighted)


def gather_expert_shard(t: Tensor, shard: tuple) -> Tensor:
    """The full [E, ...] tensor from every ep rank's slice `t` (a collective over the group)."""
    group, _, size = shard
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def slice_expert_shard(full: Tensor, shard: tuple) -> Tensor:
    """This rank's rows of a full [E, ...] tensor."""
    _, rank, size = shard
    n = full.shape[0] // size
    return full[rank * n : (rank + 1) * n]
