"""One optimizer step: microbatches forward/backward, gradient sync, clipping, update."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from mesh3d.parallel.data import allreduce_gradients
from mesh3d.train.loss import normalized_loss


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    vocab_size: int,
    global_tokens: int,
    clip_grad: float | None,
    dp_group: dist.ProcessGroup | None,
    autocast_dtype: torch.dtype | None,
    device: torch.device,
) -> tuple[float, float]:
    """Run one step; return (global mean token loss, pre-clip global gradient norm)."""
    total = torch.zeros((), device=device)
    for inputs, labels in batches:
        inputs, labels = inputs.to(device), labels.to(device)
        ctx = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            logits = model(inputs)
        loss = normalized_loss(logits, labels, vocab_size, global_tokens)
        loss.backward()
        total += loss.detach()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        allreduce_gradients(model, dp_group)
        dist.all_reduce(total, group=dp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = clip_grad if clip_grad is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(total), float(grad_norm)
