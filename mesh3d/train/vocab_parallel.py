"""The cross-entropy of vocab-sharded logits under tp (`train/loss.py` loads it only for
DTensor logits): eager and without z-loss it runs on this rank's vocabulary columns as plain
tensors (Megatron's); else under `loss_parallel()` with padding columns masked."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mesh3d.data.documents import IGNORE


@functools.lru_cache(maxsize=8)
def _local_padding(start: int, width: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[width] for vocabulary columns start..start+width-1: 0 for real tokens, -inf for padding."""
    mask = torch.zeros(width, device=device)
    mask[max(vocab_size - start, 0) :] = float("-inf")
    return mask


@functools.lru_cache(maxsize=8)
def padding_mask(mesh, padded: int, vocab_size: int, device: torch.device) -> DTensor:
    """`_local_padding` of the whole [Vp] vocabulary, sharded like the logits' vocab dim."""
    mask = _local_padding(0, padded, vocab_size, device)
    return distribute_tensor(mask, mesh, [Shard(0)], src_data_rank=None)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of the cross-entropy of vocab-sharded logits [N, W] (fp32, columns
    start..start+W-1), on plain tensors: `loss_parallel`'s result without DTensor dispatch."""

    @staticmethod
    def forward(ctx, logits, labels, group, start):
        probs, rows = sharded_softmax(logits, labels, group, start)
        valid = labels != IGNORE
        probs.mul_(valid[:, None])
        ctx.start = start
        ctx.save_for_backward(probs, labels)
        return (rows * valid).sum()

    @staticmethod
    def backward(ctx, grad):
        probs, labels = ctx.saved_tensors
        width = probs.shape[-1]
        local = labels - ctx.start
        hit = (local >= 0) & (local < width) & (labels != IGNORE)
        out = probs * grad
        out.scatter_add_(-1, local.clamp(0, width - 1)[:, None], -(hit * grad)[:, None])
        return out, None, None, None


def sharded_softmax(logits, labels, group, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax [N, W] over the whole vocabulary, cross-entropy [N]) of vocab-sharded logits."""
    width = logits.shape[-1]
    top = logits.amax(-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    probs = (logits - top[:, None]).exp_()
    local = labels - start
    mine = (local >= 0) & (local < width)
    target = logits.gather(-1, local.clamp(0, width - 1)[:, None]).squeeze(-1)
    both = torch.stack([probs.sum(-1), (target - top) * mine])
    dist.all_reduce(both, group=group)
    return probs.div_(both[0][:, None]), both[0].log() - both[1]


def _vocab_parallel(logits: DTensor) -> tuple[dist.ProcessGroup, int] | None:
    """(tp group, first vocabulary column) when the plain-tensor cross-entropy applies."""
    if torch.compiler.is_compiling() or logits.device_mesh.ndim != 1:
        return None
    if logits.placements[0] != Shard(logits.ndim - 1):
        return None
    n, width = logits.device_mesh.size(), logits.shape[-1]
    chunk = -(-width // n)  # DTensor's shards: torch.chunk's sizes
    return logits.device_mesh.get_group(), min(logits.device_mesh.get_local_rank() * chunk, width)


def sharded_loss_sum(logits: DTensor, labels: torch.Tensor, vocab_size: int):
    """`token_loss_sum` of vocab-sharded logits on plain tensors, or None where it does not
    apply (compiling, a 2-D mesh, logits not sharded on the vocabulary)."""
    sharded = _vocab_parallel(logits)
    if sharded is None:
        return None
    group, start = sharded
    local = logits.to_local().float()
    if logits.shape[-1] > vocab_size:
        local = local + _local_padding(start, local.shape[-1], vocab_size, local.device)
    flat = local.reshape(-1, local.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), group, start)
