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
gather). Vocabulary
padding columns are pushed to -inf so they never change the loss.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@functools.lru_cache(maxsize=8)
def _padding_mask(mesh, padded: int, vocab_size: int, device: torch.device) -> DTensor:
    """A [Vp] DTensor sharded like the logits' vocab dim: 0 for real tokens, -inf for padding.

    Built once per (mesh, sizes), not per microbatch.
    """
    mask = torch.zeros(padded, device=device)
    mask[vocab_size:] = float("-inf")
    return distribute_tensor(mask, mesh, [Shard(0)], src_data_rank=None)


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, z_loss: float = 0.0
) -> torch.Tensor:
    """Sum of cross-entropy over tokens. logits [B, S, Vp] (Vp >= vocab_size), labels [B, S].

    Columns at and beyond `vocab_size` (vocabulary padding) are excluded. Computed in fp32.
    Labels equal to -100 are ignored (no token in the sum). With `z_loss` > 0 each counted
    token adds z_loss * (logsumexp(logits) - max(logits))^2, Nanotron's z-loss (the max taken
    as a constant, the difference clamped to [-20, 20]).
    """
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
    total = F.cross_entropy(flat, labels, reduction="sum", ignore_index=-100)
    if z_loss:
        top = flat.detach().amax(-1, keepdim=True)  # a constant, as in Nanotron
        shifted = torch.exp(flat - top).sum(-1).log()  # (N,) logsumexp - max
        if isinstance(shifted, DTensor):
            shifted = shifted.full_tensor()
        valid = (labels != -100).to(shifted.dtype)
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

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = token_loss_sum(logits, labels, self.vocab_size, self.z_loss)
        return total / self.tokens * self.backward_scale


def step_loss(layout) -> StepLoss:
    """The run's loss function, from its `RunLayout`."""
    return StepLoss(layout.vocab_size, layout.global_tokens, layout.backward_scale, layout.z_loss)
