"""The one place the training loss is normalized.

Every microbatch returns sum(token losses) / (valid tokens of the *global* batch), times
`backward_scale` (undoing FSDP's averaging over dp), so the sum over microbatches and dp ranks
is the global mean at any layout; nothing else rescales (pipeline schedules get
`scale_grads=False`). Under tp the cross-entropy of the sharded vocabulary is
`train/vocab_parallel.py`'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mesh3d.data.documents import IGNORE


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   z_loss: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Sum of fp32 cross-entropy over tokens, logits [B, S, Vp], labels [B, S] (-100: ignored),
    columns from `vocab_size` on excluded. With `z_loss` each counted token adds Nanotron's
    z_loss * (logsumexp - max)^2 (the max a constant, the difference clamped to [-20, 20])."""
    if isinstance(logits, DTensor):  # tp: the vocabulary is sharded (loaded only then)
        from mesh3d.train.vocab_parallel import padding_mask, sharded_loss_sum

        total = None if z_loss else sharded_loss_sum(logits, labels, vocab_size)
        if total is not None:
            return total
    logits = logits.float()
    padded = logits.shape[-1] > vocab_size
    if isinstance(logits, DTensor):
        if padded:
            logits = logits + padding_mask(
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
    if not global_tokens >= 1:  # 0 would make every loss inf or nan
        raise ValueError(f"global_tokens must be >= 1 (the step's tokens), got {global_tokens}")
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
