"""The one place the training loss is normalized.

Every microbatch returns sum(token losses) / (valid tokens in the *global* batch: all
microbatches, all dp ranks). Summing these over microbatches and dp ranks gives the global mean
token loss, and backpropagating them gives the gradient of that mean, whatever the layout.
`StepLoss` is the one function both training paths (pipeline schedule and plain loop)
backpropagate: that share, times the run's `backward_scale`, which undoes FSDP's averaging over
dp. Nothing else in mesh3d rescales the loss or the gradients (pipeline schedules get
`scale_grads=False`); the reported loss is the sum divided by the same scale.

Under tensor parallelism the logits arrive as a vocab-sharded DTensor; the caller runs the loss
*and its backward* under `loss_parallel()` (max and sum-exp reduced over tp; no full-vocab
gather). In eager mode without z-loss the cross-entropy itself runs on this rank's columns as
plain tensors (`_VocabParallelCrossEntropy`: Megatron's vocab-parallel cross-entropy, two
all-reduces, none in backward); compiled code and the z-loss take `loss_parallel`'s DTensor
ops. Vocabulary padding columns are pushed to -inf so they never change the loss.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mesh3d.data.documents import IGNORE


@functools.lru_cache(maxsize=8)
def _local_padding(start: int, width: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[width] for vocabulary columns start..start+width-1: 0 for real tokens, -inf for padding.
    Built once per (sizes, device), not per microbatch."""
    mask = torch.zeros(width, device=device)
    mask[max(vocab_size - start, 0) :] = float("-inf")
    return mask


@functools.lru_cache(maxsize=8)
def _padding_mask(mesh, padded: int, vocab_size: int, device: torch.device) -> DTensor:
    """`_local_padding` of the whole [Vp] vocabulary as a DTensor sharded like the logits'
    vocab dim."""
    mask = _local_padding(0, padded, vocab_size, device)
    return distribute_tensor(mask, mesh, [Shard(0)], src_data_rank=None)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of the cross-entropy of vocab-sharded logits, on plain tensors.

    `logits` [N, W] fp32: this rank's columns start..start+W-1 of the vocabulary; `labels` [N]
    (IGNORE: no token). Forward: the row max all-reduced (MAX), then the sum of exponentials and
    the target's shifted logit (0 on the ranks not holding it) all-reduced together (SUM); the
    loss of a row is log(sum exp) - target. It saves the softmax of its columns (zero on ignored
    rows) and the labels, as `F.cross_entropy` saves its log-softmax and targets. Backward,
    locally: softmax minus the one-hot target, times the incoming gradient. What
    `loss_parallel`'s DTensor ops compute (three all-reduces there), without DTensor's dispatch
    per op and microbatch.
    """

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
    """(softmax of each row [N, W] over the whole vocabulary, each row's cross-entropy [N]) of
    vocab-sharded logits (this rank's columns start.., fp32 [N, W]): one max and one sum
    all-reduce over the tp `group`. Labels outside this rank's columns (or IGNORE) count 0 here."""
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
    """(tp group, first vocabulary column of this rank) when `logits` is vocab-sharded over one
    mesh axis and the plain-tensor cross-entropy applies (eager mode); else None."""
    if torch.compiler.is_compiling() or logits.device_mesh.ndim != 1:
        return None
    if logits.placements[0] != Shard(logits.ndim - 1):
        return None
    n, width = logits.device_mesh.size(), logits.shape[-1]
    chunk = -(-width // n)  # DTensor's shards: torch.chunk's sizes
    return logits.device_mesh.get_group(), min(logits.device_mesh.get_local_rank() * chunk, width)


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, z_loss: float = 0.0
) -> torch.Tensor:
    """Sum of cross-entropy over tokens. logits [B, S, Vp] (Vp >= vocab_size), labels [B, S].

    Columns at and beyond `vocab_size` (vocabulary padding) are excluded. Computed in fp32.
    Labels equal to -100 are ignored (no token in the sum). With `z_loss` > 0 each counted
    token adds z_loss * (logsumexp(logits) - max(logits))^2, Nanotron's z-loss (the max taken
    as a constant, the difference clamped to [-20, 20]).
    """
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


def normalized_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, global_tokens: int
) -> torch.Tensor:
    """This microbatch's share of the global mean token loss.

    Example:

        loss_fn = lambda logits, labels: mesh3d.normalized_loss(logits, labels, vocab, global_tokens)
    """
    return token_loss_sum(logits, labels, vocab_size) / global_tokens


class StepLoss:
    """`loss_fn(logits, labels)`: a microbatch's share of the step's mean token loss (z-loss
    included when set) times `backward_scale` — the run layout's dp under FSDP, whose gradient
    reduce-scatter averages over dp, else 1. `tokens`, the valid tokens of the global batch, is
    fixed for dense data and set each step under document masking (labels masked at document
    starts)."""

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
