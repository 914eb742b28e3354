"""Expert parallelism: the experts of every MoE layer split over `expert_parallel_size` ranks.

Where the ranks come from. As in Nanotron (whose world size does not count ep) and TorchTitan,
expert parallelism borrows the dp axis: ep divides dp, and the dp ranks d with the same
d // ep form an ep group (dp rank d = edp · ep + ep_rank, ep innermost). Each rank of an ep
group holds E / ep experts (ep rank r: experts r·E/ep .. (r+1)·E/ep - 1) and its own data, as
any dp rank. The ranks holding the same experts (same ep rank: the "edp" ranks, times cp) are
their replicas: expert gradients are summed over them, the other parameters' over dp x cp as
before.

One MoE layer's forward, on each rank (dropless), with the all-to-all dispatcher
(`moe_config.token_dispatcher_type: alltoall`, the default):
1. route its own tokens (the router is replicated);
2. sort the k·T routed slots by expert, and tell every ep peer how many rows it will get for
   each of its experts (an all-to-all of counts);
3. send the rows (an all-to-all with uneven splits; its backward is the reverse all-to-all);
4. run the local experts on what arrived, grouped by expert;
5. send the results back (the reverse all-to-all), weight them and add them to their tokens.

With the all-gather dispatcher (`allgather`, Megatron's and Nanotron's other kind), after 1:
2. all-gather every rank's tokens with their routing (chosen experts; weights), [ep·T, ...];
3. run the local experts on the (token, slot) pairs routed to them, weight the results and add
   them into an [ep·T, h] buffer of every rank's tokens;
4. reduce-scatter the buffer: each rank gets its own T rows, summed over the ranks.
Backward runs the transposes (a reduce-scatter of the gathered tensors' gradients, an
all-gather of the output's). The router's gradient: a slot's weight multiplies its expert's
result on the rank holding the expert, so that rank computes the weight's gradient, in the
gathered [ep·T, k] weights; the reduce-scatter in the gather's backward brings it to the
token's own rank (the other ranks add zeros for that slot). Cost: each rank receives
(ep-1)·T rows of h (+ k weights, k ids) and sends (ep-1)·T rows of h back, against about
(ep-1)/ep · k·T rows each way for all-to-all with balanced routing: ep/k times the bytes, and
an [ep·T, h] buffer; in exchange, collectives of equal sizes that never depend on the routing.
Every rank needs the same T (the same microbatch shape); a tiny all-gather checks it.

The expert weights are plain tensors holding the rank's slice of the full [E, ...] tensors;
`expert_shard` marks them (group, rank, size) for initialization, checkpoints (gathered to the
full tensor on save, sliced on load: any ep can read them) and the gradient norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mesh3d.parallel.context import all_gather_flat, reduce_scatter_flat


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's ep group and its place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    dispatcher: str = "alltoall"  # `moe_config.token_dispatcher_type`: alltoall | allgather

    def dispatch(self, experts_fn, flat: Tensor, chosen: Tensor, weights: Tensor, num_experts: int):
        """`dispatch_and_combine` or `gather_and_reduce` over this group (the `dispatcher`):
        what an MoE block calls (it imports nothing of the parallel code)."""
        combine = gather_and_reduce if self.dispatcher == "allgather" else dispatch_and_combine
        return combine(experts_fn, flat, chosen, weights, num_experts, self)


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


def new_groups(
    dims, ep: int, dispatcher: str = "alltoall"
) -> tuple[ExpertParallel, dist.ProcessGroup]:
    """This rank's `ExpertParallel` (dispatching with `dispatcher`) and expert-replica group
    (every rank creates every group, in the same order, as `new_group` requires)."""
    world, me = dist.get_world_size(), dist.get_rank()
    eps, replicas = ep_groups(world, dims, ep)
    mine_ep = mine_rep = None
    for ranks in eps:
        g = dist.new_group(ranks)
        if me in ranks:
            mine_ep = ExpertParallel(g, len(ranks), ranks.index(me), dispatcher)
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


class _GatherRows(torch.autograd.Function):
    """`gather`: every ep rank's `x` [T, ...] stacked in rank order [ep·T, ...] (all-gather);
    else the transpose: [ep·T, ...] summed over the ranks, each keeping its T rows
    (reduce-scatter). Backward runs the other one."""

    @staticmethod
    def forward(ctx, x: Tensor, gather: bool, ep: ExpertParallel) -> Tensor:
        ctx.gather, ctx.ep = gather, ep
        return _gather_or_scatter(x, gather, ep)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_or_scatter(grad, not ctx.gather, ctx.ep), None, None


def _gather_or_scatter(x: Tensor, gather: bool, ep: ExpertParallel) -> Tensor:
    rows = x.shape[0] * ep.size if gather else x.shape[0] // ep.size
    out = x.new_empty((rows, *x.shape[1:]))
    collective = all_gather_flat if gather else reduce_scatter_flat
    collective(out, x.contiguous(), group=ep.group)
    return out


def gather_and_reduce(
    experts_fn, flat: Tensor, chosen: Tensor, weights: Tensor, num_experts: int, ep: ExpertParallel
) -> Tensor:
    """`dispatch_and_combine`'s result by all-gather and reduce-scatter (module doc): the same
    arguments; every rank of the group must have the same T."""
    t, k = chosen.shape
    # unequal sizes would make the collectives below fail or hang: check (8 bytes per rank)
    sizes = flat.new_empty(ep.size, dtype=torch.int64)
    all_gather_flat(sizes, torch.tensor([t], device=flat.device), group=ep.group)
    if len(set(sizes.tolist())) > 1:
        raise ValueError(
            f"token_dispatcher_type allgather needs the same number of tokens on every rank of "
            f"an ep group, got {sizes.tolist()}: give every rank the same microbatch shape, or "
            f"set moe_config.token_dispatcher_type: alltoall"
        )
    # tokens and their weights travel together, the weights in the tokens' dtype (as they
    # multiply the results in `dispatch_and_combine`); the gather's backward brings each
    # weight's gradient from the rank that ran its expert
    both = _GatherRows.apply(torch.cat([flat, weights.to(flat.dtype)], dim=1), True, ep)
    tokens, all_weights = both.split([flat.shape[1], k], dim=1)  # [ep·T, h], [ep·T, k]
    all_chosen = _gather_or_scatter(chosen, True, ep)  # [ep·T, k], no gradient
    slot_expert = all_chosen.reshape(-1)
    order = torch.argsort(slot_expert, stable=True)  # slots grouped by expert, then by token
    counts = torch.bincount(slot_expert, minlength=num_experts)
    local = num_experts // ep.size
    first = ep.rank * local  # this rank's experts: first .. first + local - 1
    ends = [0, *counts.cumsum(0).tolist()]
    mine = order[ends[first] : ends[first + local]]  # the slots routed to them, by expert
    token_of = mine // k
    ran = experts_fn(tokens[token_of], counts[first : first + local])
    weighted = ran * all_weights.reshape(-1)[mine, None]
    partial = tokens.new_zeros(tokens.shape).index_add(0, token_of, weighted)  # [ep·T, h]
    return _GatherRows.apply(partial, False, ep)  # [T, h]: own tokens, summed over the ranks


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


def apply_ep(model: nn.Module, ep, moe: tuple[type, ...]) -> None:
    """Every MoE block of `model` (on meta) keeps its ep rank's E / ep experts and dispatches
    tokens over `ep`; its expert stacks get `ep_shard` = (group, rank, size)."""
    for module in model.modules():
        if isinstance(module, moe):
            module.ep = ep
            ex = module.experts
            ex.ep_shard = (ep.group, ep.rank, ep.size)
            for pname, p in list(ex.named_parameters(recurse=False)):
                local = (p.shape[0] // ep.size, *p.shape[1:])
                ex.register_parameter(pname, nn.Parameter(torch.empty(local, device=p.device)))
