"""The one place the training loss is normalized.

Every microbatch returns sum(token losses) / (valid tokens in the *global* batch: all
microbatches, all dp ranks). Summing these over microbatches and dp ranks gives the global mean
token loss, and backpropagating them gives the gradient of that mean, whatever the layout.
`step_loss` is the one function both training paths (pipeline schedule and plain loop)
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
from collections.abc import Callable

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


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sum of cross-entropy over tokens. logits [B, S, Vp] (Vp >= vocab_size), labels [B, S].

    Columns at and beyond `vocab_size` (vocabulary padding) are excluded. Computed in fp32.
    Labels equal to -100 are ignored (no token in the sum).
    """
    logits = logits.float()
    padded = logits.shape[-1] > vocab_size
    if isinstance(logits, DTensor):
        if padded:
            logits = logits + _padding_mask(
                logits.device_mesh, logits.shape[-1], vocab_size, logits.device
            )
        return F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
        )
    if padded:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=-100
    )


def normalized_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, global_tokens: int
) -> torch.Tensor:
    """This microbatch's share of the global mean token loss.



    Example:



        loss_fn = lambda logits, labels: mesh3d.normalized_loss(logits, labels, vocab, global_tokens)


    """
    return token_loss_sum(logits, labels, vocab_size) / global_tokens


def step_loss(vocab_size: int, global_tokens: int, backward_scale: int) -> Callable:
    """`loss_fn(logits, labels)`: a microbatch's `normalized_loss` times `backward_scale` (the
    run layout's: dp under FSDP, whose gradient reduce-scatter averages over dp, else 1)."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return normalized_loss(logits, labels, vocab_size, global_tokens) * backward_scale

    return loss_fn
