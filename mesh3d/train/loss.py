"""The one place the training loss is normalized.

Every microbatch returns sum(token losses) / (valid tokens in the *global* batch: all
microbatches, all dp ranks). Summing these over microbatches and dp ranks gives the global mean
token loss, and backpropagating them gives the gradient of that mean, whatever the layout.
Nothing else in mesh3d rescales the loss or the gradients (pipeline schedules get
`scale_grads=False`; data-parallel averaging is compensated where it is applied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sum of cross-entropy over tokens. logits [B, S, Vp] (Vp >= vocab_size), labels [B, S].

    Columns at and beyond `vocab_size` (vocabulary padding) are excluded, so padding never
    changes the loss. Computed in fp32. Labels < 0 are ignored (no token in the sum).
    """
    logits = logits.float()
    if logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum", ignore_index=-100
    )


def normalized_loss(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, global_tokens: int
) -> torch.Tensor:
    """This microbatch's share of the global mean token loss."""
    return token_loss_sum(logits, labels, vocab_size) / global_tokens
