"""Context parallelism: the sequence of every sample split over the ranks of the "cp" axis.

Layout of the tokens. The sequence is cut into 2·cp chunks of S / (2·cp) tokens; cp rank r
holds chunk r (a head chunk) and chunk 2·cp-1-r (a tail chunk), in that order. Under causal
attention a query attends to every key before it, so a head chunk is cheap and a tail chunk
expensive; one of each gives every rank the same work (cp 2: rank 0 holds chunks 0 and 3,
rank 1 chunks 1 and 2). Everything outside attention is per token and runs on the local
tokens unchanged; RoPE gets each token's real position, so its angles are those of one process.

Attention across the shards: all-gather of K and V (Llama 3's method), not a ring. Each rank
gathers the full K and V once per layer (one all-gather; its backward is one reduce-scatter of
their gradients), puts them in sequence order, and attends its two query chunks against the
keys before their end. Why not a ring with online softmax:
- any mask works as is: document masking and sliding windows are a boolean mask over global
  token indices, exactly the one-process mask restricted to this rank's rows (a ring needs a
  per-block mask and skip logic for each);
- K and V are small with grouped-query attention (n_kv heads of n_q), so the gathered bytes
  are (cp-1)/cp · 2 · S · n_kv · head_dim per layer, against the ring's same volume in cp-1
  steps that overlap compute only with asynchronous P2P, which gloo does not give;
- one collective per layer instead of cp-1 exchanges: fewer round trips on CPU/gloo.
The cost: every rank holds the full K and V of a layer while it runs (and saves them for
backward): 2 · S · n_kv · head_dim values per layer instead of S/cp. Queries, scores, the
MLP and the residual stream all stay at S/cp.

Kernels: a chunk without documents or windows uses torch's lower-right causal bias
(`causal_lower_right`) on CUDA, which SDPA runs with its flash or memory-efficient kernels
without a mask in memory; on CPU one additive mask per chunk shape, shared by all layers (the
CPU kernel saves its mask for backward, so a bias per call would cost a [S/2cp, keys] tensor per
layer). Documents and windows pass a boolean mask, as without cp. Parameters are replicated
over cp: their gradients are summed over dp×cp (`mesh.replica_mesh`), and the loss, a sum over
local tokens divided by the global token count, needs no change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from mesh3d.tp_styles import all_gather_flat, reduce_scatter_flat, summed_over


@dataclass(frozen=True)
class ContextParallel:
    """The cp group of this rank, as attention needs it; `documents`: document masking is on
    (positions restart at 0 in each document), else positions are plain 0..S-1."""

    group: dist.ProcessGroup
    size: int
    rank: int
    documents: bool = False

    def attend(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, window: int | None):
        """`cp_attention` over this group: what an attention module calls (it imports nothing
        of the parallel code)."""
        return cp_attention(q, k, v, positions, window, self)

    def gather(self, t: Tensor) -> Tensor:
        """The whole sequence of `t` [B, S/cp, ...] in natural order (`gather_sequence`): for
        an attention that computes its probabilities itself (e.g. to drop some)."""
        return gather_sequence(t, self)


def local_indices(seq_len: int, cp: int, rank: int, device=None) -> Tensor:
    """The global token indices cp rank `rank` holds, in local order: chunk `rank`, then chunk
    2·cp-1-`rank` (chunks of seq_len / (2·cp))."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp}")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat((head, tail))


@functools.lru_cache(maxsize=32)
def gathered_order(seq_len: int, cp: int, device=None) -> Tensor:
    """For the rank-by-rank concatenation of every rank's local tokens, where global token i
    sits: `gathered[:, order]` is the sequence in its natural order. Cached: every layer's
    all-gather asks for it (do not modify the result)."""
    where = torch.cat([local_indices(seq_len, cp, r) for r in range(cp)])  # slot -> token
    order = torch.empty_like(where)
    order[where] = torch.arange(seq_len)
    return order.to(device)


def shard_sequence(t: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This cp rank's tokens of `t` (full sequence along `dim`), in local order."""
    if cp == 1:
        return t
    return t.index_select(dim, local_indices(t.shape[dim], cp, rank, t.device))


def shard_batches(batches: list[tuple], cp: int, rank: int, documents: bool) -> list[tuple]:
    """(inputs, labels, positions) of this cp rank for each microbatch (inputs, labels[,
    positions]) of full sequences. Positions are the document positions under document
    masking, else 0..S-1: RoPE needs each token's real position once the sequence is split."""
    out = []
    for inputs, labels, *rest in batches:
        if rest:
            positions = rest[0]
        else:
            b, s = inputs.shape[:2]
            positions = torch.arange(s, device=inputs.device).expand(b, s)
        out.append(tuple(shard_sequence(t, cp, rank) for t in (inputs, labels, positions)))
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 over the cp group into natural sequence order; backward sums
    the gradients of every rank's copy and hands each rank its own tokens' part."""

    @staticmethod
    def forward(ctx, x: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        full = _all_gather(x, cp)  # (B, cp·Sl, ...) in rank order
        ctx.order = gathered_order(full.shape[1], cp.size, x.device)
        return full.index_select(1, ctx.order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp = ctx.cp
        b, seq = grad.shape[:2]
        by_rank = torch.empty_like(grad)
        by_rank.index_copy_(1, ctx.order, grad)  # back to rank order
        by_rank = by_rank.unflatten(1, (cp.size, seq // cp.size)).transpose(
            0, 1
        )  # (cp, B, Sl, ...)
        out = torch.empty(by_rank.shape[1:], dtype=grad.dtype, device=grad.device)
        reduce_scatter_flat(out, by_rank.flatten(0, 1).contiguous(), group=cp.group)
        return out, None


def _all_gather(x: Tensor, cp: ContextParallel) -> Tensor:
    """Every cp rank's `x` [B, Sl, ...] side by side along dim 1, in rank order."""
    parts = torch.empty((cp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(parts, x.contiguous(), group=cp.group)
    return parts.unflatten(0, (cp.size, x.shape[0])).transpose(0, 1).flatten(1, 2)


def gather_sequence(x: Tensor, cp: ContextParallel) -> Tensor:
    """The full sequence of `x` [B, S/cp, ...] from every cp rank, in natural order
    (differentiable)."""
    return _GatherSequence.apply(x, cp)


def _chunk_mask(rows: Tensor, keys: int, window: int | None, docs: Tensor | None) -> Tensor | None:
    """Boolean mask (True: attend) of queries at global indices `rows` over keys 0..keys-1;
    None when plain lower-right causal suffices."""
    if window is None and docs is None:
        return None
    k = torch.arange(keys, device=rows.device)
    mask = rows[:, None] >= k[None, :]
    if window is not None:
        mask = mask & (rows[:, None] - k[None, :] < window)
    mask = mask[None]  # (1, c, keys)
    if docs is not None:  # (B, S) document ids
        mask = mask & (docs[:, rows][:, :, None] == docs[:, None, :keys])
    return mask[:, None]  # (B|1, 1, c, keys)


def _lower_right(rows: int, keys: int, dtype: torch.dtype, device: torch.device):
    """The causal mask of the last `rows` queries over `keys` keys (lower-right aligned).

    On CUDA, torch's `causal_lower_right` bias, which SDPA runs with its flash or
    memory-efficient kernel and never materializes. The CPU kernel materializes a bias (and
    saves it for backward) on every call, one per layer: there, one additive mask per shape,
    shared by every layer and step, is saved once instead.
    """
    if device.type == "cuda":
        return causal_lower_right(rows, keys)
    return _additive_lower_right(rows, keys, dtype, device)


@functools.lru_cache(maxsize=16)
def _additive_lower_right(rows: int, keys: int, dtype: torch.dtype, device: torch.device):
    allowed = torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def cp_attention(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, window: int | None, cp: ContextParallel
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    q [B, S/cp, nq, dh], k and v [B, S/cp, nkv, dh] (local tokens, RoPE applied), positions
    [B, S/cp]. Returns [B, S/cp, nq, dh] in local order.
    """
    seq = q.shape[1] * cp.size
    k_full, v_full = gather_sequence(k, cp), gather_sequence(v, cp)  # (B, S, nkv, dh)
    docs = None
    if cp.documents:  # document ids need every position: gather them (no gradient)
        order = gathered_order(seq, cp.size, q.device)
        pos = _all_gather(positions.to(q.device), cp).index_select(1, order)
        docs = torch.cumsum((pos == 0).int(), dim=-1)  # (B, S)
    c = seq // (2 * cp.size)
    gqa = q.shape[2] != k.shape[2]
    outs = []
    for half, chunk in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
        end = (chunk + 1) * c  # keys after the chunk's last query are never attended
        qc = q[:, half * c : (half + 1) * c].transpose(1, 2)  # (B, nq, c, dh)
        kc, vc = (t[:, :end].transpose(1, 2) for t in (k_full, v_full))  # (B, nkv, end, dh)
        rows = torch.arange(chunk * c, end, device=q.device)
        mask = _chunk_mask(rows, end, window, docs)
        if mask is None and end == c:  # the first chunk: plain causal, no mask at all
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=gqa)
        else:
            if mask is None:
                mask = _lower_right(c, end, q.dtype, q.device)
            out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=gqa)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, documents: bool, blocks) -> None:
    """Attention modules of `model` attend across the sequence shards of `cp_mesh`; MoE blocks
    sum their per-sequence load statistics over them."""
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(),
                                 documents)  # fmt: skip
    for module in model.modules():
        if isinstance(module, blocks.attention):
            module.cp = cp
        if isinstance(module, blocks.moe):  # its load statistics span the whole sequence
            module.sequence_sums.append(summed_over(cp.group))
