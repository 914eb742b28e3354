"""Validation loss: a forward-only pass over the held-out batches, at any layout. `val_loss`
is the token cross-entropy sum (float64, over dp and pp; no z-loss) / counted tokens."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from mesh3d import extensions
from mesh3d.data.validation import HeldOut
from mesh3d.layout import RunLayout
from mesh3d.mesh import groups_of
from mesh3d.train.build import ModelParts
from mesh3d.train.loss import StepLoss, token_loss_sum
from mesh3d.train.step import _autocast, _cat, _loss_ctx, _scalar, with_documents, with_sft


def is_evaluation_step(tokens, step: int) -> bool:
    """Whether step `step` (1-based) ends with a validation pass (`tokens` = cfg.tokens)."""
    interval = tokens.val_check_interval
    if interval > tokens.train_steps:  # a run shorter than the interval: its last step
        return tokens.limit_val_batches > 0 and step == tokens.train_steps
    return interval > 0 and tokens.limit_val_batches > 0 and step % interval == 0


def perplexity(loss: float) -> float:
    """exp(loss), inf past float range (and nan for a nan loss)."""
    return math.exp(loss) if not loss > 700.0 else math.inf


@torch.no_grad()
def evaluate(parts: ModelParts, held: HeldOut, layout: RunLayout, mesh,
             device: torch.device) -> dict[str, float]:  # fmt: skip
    """{"val_loss", "val_ppl"} over `held`, the same on every rank (call on every rank)."""
    dp, pp, cp = layout.dims.dp, layout.dims.pp, layout.dims.cp
    groups = groups_of(mesh)
    # middle pipeline stages take activations, not tokens, unless attention needs the positions
    reads = parts.has_first or parts.has_last or layout.positions_everywhere
    mbs, dp_rank = layout.microbatch_size, layout.coords["dp"]
    batches = [held.batches(b, dp_rank, dp, mbs) if reads else [] for b in range(held.num_batches)]
    if layout.sft or layout.doc_masking:  # the tokens that have labels, summed over dp
        documents = with_sft if layout.sft else with_documents
        flat, tokens = documents([mb for b in batches for mb in b], layout, groups.dp, device)
        n = len(batches[0])
        batches = [flat[i * n : (i + 1) * n] for i in range(held.num_batches)]
    else:
        tokens = held.num_batches * held.global_batch * layout.sequence_length
    if cp > 1:  # this cp rank's tokens of the same samples (and their positions)
        shard = extensions.load("context_parallel").shard_batches
        batches = [shard(b, cp, layout.coords["cp"], layout.doc_masking) for b in batches]
    modes = [m.training for m in parts.modules]
    for m in parts.modules:
        m.eval()
    try:
        total = _token_loss_sum(parts, batches, layout, device)
    finally:
        for m, mode in zip(parts.modules, modes):
            m.train(mode)
        _reshard(parts.modules)
    if pp > 1:
        dist.all_reduce(total, group=groups.pp)  # only the last stage has sums
    if dp * cp > 1:
        dist.all_reduce(total, group=groups.replicas)
    loss = float(total) / tokens
    return {"val_loss": loss, "val_ppl": perplexity(loss)}


def _token_loss_sum(parts: ModelParts, batches: list[list[tuple]], layout: RunLayout,
                    device: torch.device) -> torch.Tensor:  # fmt: skip
    """This rank's sum of token cross-entropies over its microbatches of every batch (float64)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    autocast, tp = layout.autocast_dtype, layout.dims.tp
    if parts.schedule is None:
        model = parts.modules[0]
        for inputs, labels, *positions in (mb for batch in batches for mb in batch):
            kwargs = {"positions": positions[0].to(device)} if positions else {}
            with _autocast(device, autocast):
                logits = model(inputs.to(device), **kwargs)
            with _loss_ctx(tp):
                total += _scalar(token_loss_sum(logits, labels.to(device), layout.vocab_size))
        return total
    from mesh3d.parallel.pipeline import is_v_schedule, run_schedule  # pp > 1 only
    from mesh3d.parallel.pipeline_forward import forward_walk

    with _token_sums(parts.loss_fn):
        for batch in batches:
            inputs = _cat(batch, 0, device) if parts.has_first else None
            labels = _cat(batch, 1, device) if parts.has_last else None
            positions = _cat(batch, 2, device) if batch and len(batch[0]) > 2 else None
            with _autocast(device, autocast), _loss_ctx(tp):
                if is_v_schedule(layout.schedule):  # torch 2.13's eval() asserts on V schedules
                    losses = forward_walk(
                        parts.stages, layout.microbatches, inputs, labels, positions,
                        parts.loss_fn, layout.activation(),
                    )  # fmt: skip
                else:
                    losses = run_schedule(parts.schedule, parts.stages, inputs, labels, positions,
                                          forward_only=True)  # fmt: skip
            for loss in losses:
                total += _scalar(loss)
    return total


@contextlib.contextmanager
def _token_sums(loss_fn: StepLoss):
    """The run's `StepLoss` returning plain sums of token cross-entropies while inside."""
    saved = loss_fn.tokens, loss_fn.backward_scale, loss_fn.z_loss
    loss_fn.tokens, loss_fn.backward_scale, loss_fn.z_loss = 1, 1, 0.0
    try:
        yield
    finally:
        loss_fn.tokens, loss_fn.backward_scale, loss_fn.z_loss = saved


def _reshard(modules: list[torch.nn.Module]) -> None:
    """Reshard every FSDP module that a no-grad forward left gathered (no-op otherwise)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
