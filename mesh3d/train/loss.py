"""The one place the training loss is normalized.

Every microbatch returns sum(token losses) / (valid tokens of the *global* batch), times
`backward_scale` (undoing FSDP's averaging over dp), so the sum over microbatches and dp ranks
is the global mean at any layout; nothing else rescales (pipeline schedules get
`scale_grads=False`). Under tp, eager and without z-loss, the cross-entropy runs on this rank's
vocabulary columns as plain tensors (Megatron's); else under `loss_parallel()`."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mesh3d.data.documents import IGNORE


@functools.lru_cache(maxsize=8)
def _local_padding(start: int, width: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[width] for vocabulary columns start..start+width-1: 0 for real tokens, -inf for padding."""
    mask = torch.zeros(width, device=device)
    mask[max(vocab_size - start, 0) :] = float("-inf")
    return mask


@functools.lru_cache(maxsize=8)
def _padding_mask(mesh, padded: int, vocab_size: int, device: torch.device) -> DTensor:
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


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   z_loss: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Sum of fp32 cross-entropy over tokens, logits [B, S, Vp], labels [B, S] (-100: ignored),
    columns from `vocab_size` on excluded. With `z_loss` each counted token adds Nanotron's
    z_loss * (logsumexp - max)^2 (the max a constant, the difference clamped to [-20, 20])."""
    sharded = _vocab_parallel(logits) if isinstance(logits, DTensor) and not z_loss else None
    if sharded is not None:
        group, start = sharded
        local = logits.to_local().float()
        if logits.shape[-1] > vocab_size:
            local = local + _local_padding(start, local.shape[-1], vocab_size, local.device)
        flat = local.reshape(-1, local.shape[-1])
        return _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), group, start)
    logits = logits.float()
    padded = logits.shape[-1] > vocab_size
    if isinstance(logits, DTensor):
        if padded:
            logits = logits + _padding_mask(
                logits.device_mesh, logits.shape[-1], vocab_size, logits.device
            )
        flat = logits.flatten(0, 1)
    else:
        if padded:
            logits = logits[..., :vocab_size]
        flat = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    total = F.cross_entropy(flat, labels, reduction="sum", ignore_index=IGNORE)
    if z_loss:
        top = flat.detach().amax(-1, keepdim=True)  # a constant, as in Nanotron
        shifted = torch.exp(flat - top).sum(-1).log()  # (N,) logsumexp - max
        if isinstance(shifted, DTensor):
            shifted = shifted.full_tensor()
        valid = (labels != IGNORE).to(shifted.dtype)
        if isinstance(total, DTensor):  # loss_parallel's cross-entropy: a replicated DTensor
            total = total.full_tensor()
        total = total + z_loss * (shifted.clamp(-20, 20).square() * valid).sum()
    return total


def normalized_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                    global_tokens: int) -> torch.Tensor:  # fmt: skip
    """This microbatch's share of the global mean token loss.

    Example:

        loss_fn = lambda logits, labels: mesh3d.normalized_loss(logits, labels, vocab, global_tokens)
    """
    return token_loss_sum(logits, labels, vocab_size) / global_tokens


class StepLoss:
    """`loss_fn(logits, labels)`: a microbatch's share of the step's mean token loss (z-loss
    included) times `backward_scale` (dp under FSDP, whose reduce-scatter averages, else 1).
    `tokens`, the global batch's valid tokens, is set each step under document masking."""

    def __init__(self, vocab_size: int, tokens: int, backward_scale: int, z_loss: float = 0.0):
        self.vocab_size, self.tokens = vocab_size, tokens
        self.backward_scale, self.z_loss = backward_scale, z_loss
        self.instead = None  # a forward-only pass's own use of the logits (downstream scores)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.instead is not None:
            return self.instead(logits, labels)
        total = token_loss_sum(logits, labels, self.vocab_size, self.z_loss)
        return total / self.tokens * self.backward_scale


def step_loss(layout) -> StepLoss:
    """The run's loss function, from its `RunLayout`."""
    return StepLoss(layout.vocab_size, layout.global_tokens, layout.backward_scale, layout.z_loss)
