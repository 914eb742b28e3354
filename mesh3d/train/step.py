"""One optimizer step: microbatches forward/backward, gradient sync, clipping, update."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from mesh3d.parallel.data import allreduce_gradients
from mesh3d.parallel.tensor import reduce_partial_grads
from mesh3d.train.loss import normalized_loss


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Pre-clip global L2 norm of the gradients; scale them down to `max_norm` if above.

    With DTensor gradients (tp shards, FSDP shards) the norm is the norm of the full tensors:
    sharded parameters count their shards once, replicated ones once.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


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
    dp_mode: str,
    tp_size: int,
    autocast_dtype: torch.dtype | None,
    device: torch.device,
) -> tuple[float, float]:
    """Run one step; return (global mean token loss, pre-clip global gradient norm).

    `dp_mode` 'replicate' sums gradients over dp after the last microbatch; with FSDP ('zero1',
    'full') gradients are reduce-scattered *averaged* over dp, so the backward loss is scaled by
    the dp size to keep the one-process gradient (gloo has no PREMUL_SUM to do it in FSDP).
    """
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    backward_scale = dp if dp_mode != "replicate" else 1
    total = torch.zeros((), device=device)
    for inputs, labels in batches:
        inputs, labels = inputs.to(device), labels.to(device)
        amp = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with amp:
            logits = model(inputs)
        with loss_parallel() if tp_size > 1 else contextlib.nullcontext():
            loss = normalized_loss(logits, labels, vocab_size, global_tokens)
            (loss * backward_scale).backward()
        loss = loss.detach()
        total += loss.full_tensor() if isinstance(loss, DTensor) else loss
    if dp > 1:
        if dp_mode == "replicate":
            allreduce_gradients(model, dp_group)
        dist.all_reduce(total, group=dp_group)
    params = [p for p in model.parameters() if p.grad is not None]
    reduce_partial_grads(params)
    grad_norm = clip_grad_norm(params, clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return float(total), grad_norm
