"""One optimizer step: forward/backward over the microbatches, gradient sync, clipping, update.

Order after backward: dp x cp gradient sum (zero_stage 0; FSDP reduced already), tied-embedding
sum across pipeline stages, one reduction of `Partial` gradients (sequence-parallel norms),
global norm and clipping, optimizer step (skipped when not finite) and LR-scheduler step."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from mesh3d import extensions
from mesh3d.data.documents import IGNORE, document_positions, mask_document_starts
from mesh3d.layout import RunLayout
from mesh3d.mesh import groups_of
from mesh3d.models.spec import tied_ends
from mesh3d.parallel.data import allreduce_gradients, allreduce_param_grads
from mesh3d.train.build import ModelParts


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None,
                   norm_params: list[torch.nn.Parameter] | None = None,
                   pp_group: dist.ProcessGroup | None = None) -> float:  # fmt: skip
    """Pre-clip global L2 norm of the gradients; scale all of `params` down to `max_norm`.

    The norm is over `norm_params` (default `params`; leave a tied copy out), summed over
    `pp_group`'s stages; DTensor gradients count as full tensors (shards once, replicas once).

    Example:

        norm = mesh3d.clip_grad_norm(list(model.parameters()), 1.0, pp_group=mesh["pp"].get_group())
    """
    params = list(params)  # (a generator, as torch's clip_grad_norm_ takes, is read twice)
    counted = [p for p in (params if norm_params is None else norm_params) if p.grad is not None]
    total = _total_norm([p.grad for p in counted if getattr(p, "expert_shard", None) is None])
    sliced = [p for p in counted if getattr(p, "expert_shard", None) is not None]
    if sliced:  # expert-parallel slices: their squares summed over the ep group
        sq = sum(_local_grad(p).double().pow(2).sum() for p in sliced)
        dist.all_reduce(sq, group=sliced[0].expert_shard[0])
        total = (total.double() ** 2 + sq).sqrt().to(total.dtype)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        sq = total.double() ** 2
        dist.all_reduce(sq, group=pp_group)
        total = sq.sqrt().to(total.dtype)
    if max_norm is not None:  # expert slices apart: plain next to FSDP's DTensors under zero 1
        for alike in _alike(params, lambda p: p.grad):
            torch.nn.utils.clip_grads_with_norm_(alike, max_norm, total)
    return float(total)


def _alike(items: list, of=lambda t: t) -> list[list]:
    """`items` grouped by their tensor's kind (plain, DTensor of each mesh, expert slices), in
    order: foreach kernels refuse a mix."""
    groups: dict = {}
    for item in (i for i in items if of(i) is not None):
        kind = (getattr(item, "expert_shard", None) is None, getattr(of(item), "device_mesh", 0))
        groups.setdefault(kind, []).append(item)
    return list(groups.values())


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads` as full tensors (DTensor shards counted once)."""
    norms = [torch.nn.utils.get_total_norm(alike, 2.0) for alike in _alike(grads)]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms] or [torch.zeros(())]
    return norms[0] if len(norms) == 1 else torch.stack(norms).double().norm().to(norms[0].dtype)


def _local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def _loss_ctx(tp_size: int):
    return loss_parallel() if tp_size > 1 else contextlib.nullcontext()


def _cat(batch: list[tuple], i: int, device: torch.device) -> torch.Tensor:
    """Item `i` (inputs, labels, positions) of a batch's microbatches, stacked: [n * mbs, S]."""
    return torch.cat([mb[i] for mb in batch]).to(device)


def _scalar(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def forward_backward(parts: ModelParts, batches: list[tuple[torch.Tensor, ...]],
                     layout: RunLayout, device: torch.device,
                     keys: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Backward of this rank's microbatches (inputs, labels[, positions]) with `parts.loss_fn`;
    returns its part of the step loss, divided by `backward_scale` once, here. `keys`
    [n·mbs, S/cp]: each token's dropout key, given to the model as `token_keys`. With a
    pipeline only the last stage's ranks get losses."""
    total = torch.zeros((), device=device)
    autocast, tp = layout.autocast_dtype, layout.dims.tp
    for reducer in parts.reducers:  # zero_stage 0: buckets reduced as the last backward goes
        reducer.begin(layout.microbatches)
    if parts.schedule is None:
        model = parts.modules[0]
        rows = keys.split(layout.microbatch_size) if keys is not None else [None] * len(batches)
        for (inputs, labels, *positions), mb_keys in zip(batches, rows, strict=True):
            # pinned by the loader on CUDA: the copies overlap the previous microbatch
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            kwargs = {"positions": positions[0].to(device, non_blocking=True)} if positions else {}
            if mb_keys is not None:
                kwargs["token_keys"] = mb_keys
            with _autocast(device, autocast):
                logits = model(inputs, **kwargs)
            with _loss_ctx(tp):
                loss = parts.loss_fn(logits, labels)
                loss.backward()
            total += _scalar(loss)
    else:
        inputs = _cat(batches, 0, device) if parts.has_first else None
        labels = _cat(batches, 1, device) if parts.has_last else None
        # every stage's attention needs the positions: all read
        positions = _cat(batches, 2, device) if batches and len(batches[0]) > 2 else None
        from mesh3d.parallel.pipeline import run_schedule  # pp > 1 only

        stages, schedule = parts.pipeline_at(layout.sequence_length)
        with _autocast(device, autocast), _loss_ctx(tp):
            losses = run_schedule(schedule, stages, inputs, labels, positions,
                                  token_keys=keys)  # fmt: skip
        for loss in losses:
            total += _scalar(loss)
    return total / layout.backward_scale


def step_token_keys(layout: RunLayout, step: int, device) -> torch.Tensor | None:
    """Each token's dropout key for this rank's microbatches of `step`, [n·mbs, S/cp] (None:
    no dropout): a hash of (seed, step, sample index in the global batch, position), so every
    layout draws the one-process masks without reading data (dp rank r holds samples
    r·n·mbs .. (r+1)·n·mbs - 1)."""
    if not layout.dropout:
        return None
    rows = layout.microbatches * layout.microbatch_size
    samples = layout.coords["dp"] * rows + torch.arange(rows)
    cp, s = layout.dims.cp, layout.sequence_length
    if cp > 1:
        positions = extensions.load("context_parallel").local_indices(s, cp, layout.coords["cp"])
    else:
        positions = torch.arange(s)
    return extensions.load("dropout").token_keys(layout.seed, step, samples, positions).to(device)


def with_documents(batches: list[tuple], layout: RunLayout, dp_group, device) -> tuple[list, int]:
    """(inputs, labels, positions) per microbatch, and the tokens with a label, summed over dp.
    Positions: an SFT row's own, else with document masking the documents' (their first
    labels masked), else 0..S-1."""
    eos, out = layout.eos_token_id, []
    for inputs, labels, *rest in batches:
        if rest:
            positions = rest[0]
        elif layout.doc_masking:
            labels = mask_document_starts(labels, inputs, eos)
            positions = document_positions(inputs, eos)
        else:
            b, s = inputs.shape
            positions = torch.arange(s).expand(b, s)
        out.append((inputs, labels, positions))
    valid = sum(int((labels != IGNORE).sum()) for _, labels, *_ in out)
    count = torch.tensor([valid], dtype=torch.int64, device=device)
    if layout.dims.dp > 1:
        dist.all_reduce(count, group=dp_group)
    return out, int(count.item())


def prepare_batches(batches: list[tuple], layout: RunLayout, dp_group,
                    device) -> tuple[list[tuple], int | None]:  # fmt: skip
    """The microbatches as this rank runs them (labels masked and positions added for
    documents, then this cp rank's tokens), and the global batch's valid-token count (None:
    dense data; over full samples, shared by a dp rank's cp ranks)."""
    tokens = None
    if layout.sft:
        batches, tokens = with_sft(batches, layout, dp_group, device)
    elif layout.doc_masking:
        batches, tokens = with_documents(batches, layout, dp_group, device)
    if layout.dims.cp > 1:
        context = extensions.load("context_parallel")
        batches = context.shard_batches(batches, layout.dims.cp, layout.coords["cp"],
                                        layout.documents)  # fmt: skip
    return batches, tokens


def with_sft(batches: list[tuple], layout: RunLayout, dp_group, device) -> tuple[list, int]:
    """SFT data (a pretraining stage's rows too): as `with_documents`, at least 1 token."""
    out, tokens = with_documents(batches, layout, dp_group, device)
    return out, max(tokens, 1)


def train_step(parts: ModelParts, optimizer: torch.optim.Optimizer, scheduler,
               batches: list[tuple[torch.Tensor, torch.Tensor]], *, layout: RunLayout,
               clip_grad: float | None, mesh, device: torch.device,
               accepts: Callable[[float, float], bool] | None = None, step: int = 0,
               across=None) -> tuple[float, float]:  # fmt: skip
    """Run step `step`; return (global mean token loss, pre-clip global gradient norm).
    A non-finite loss or norm (the same on every rank) skips the update, and so does a step
    `accepts(loss, grad_norm)` refuses; the caller decides whether the run goes on. `across`
    (a fault-tolerant run's `Replicas`): loss and gradients become the mean over the groups
    alive this step; the update and the LR schedule advance only if the step commits."""
    g = groups_of(mesh)
    pp, pp_group = g.pp_size, g.pp
    batches, tokens = prepare_batches(batches, layout, g.dp, device)
    parts.loss_fn.tokens = layout.global_tokens if tokens is None else tokens  # S: the stage's
    total = forward_backward(parts, batches, layout, device, step_token_keys(layout, step, device))
    if pp > 1:
        dist.all_reduce(total, group=pp_group)  # only the last stage's ranks hold the loss
    if g.dp_size * layout.dims.cp > 1:
        if layout.dp_mode == "replicate":
            for reducer in parts.reducers:  # what the backward has not reduced yet, then wait
                reducer.finish()
            if not parts.reducers:
                for m in parts.modules:
                    allreduce_gradients(m, g.replicas)  # expert-parallel slices left out
        if parts.expert_replicas is not None:  # they sum over the ranks holding them
            sliced = [p for p in parts.parameters() if getattr(p, "expert_shard", None)]
            allreduce_param_grads(sliced, parts.expert_replicas)
            if layout.backward_scale != 1:  # FSDP's scale, which their plain sum does not undo
                for p in sliced:
                    if p.grad is not None:
                        p.grad.div_(layout.backward_scale)
        dist.all_reduce(total, group=g.replicas)
    if across is not None:
        with_grads = [p for p in parts.parameters() if p.grad is not None]
        total = across.reduce(with_grads, total, layout.global_tokens if tokens is None else tokens)
    if pp > 1:
        from mesh3d.parallel.pipeline import sync_tied_embeddings

        sync_tied_embeddings(parts.modules, pp_group, parts.embed_rank, parts.head_rank)
    params = [p for p in parts.parameters() if p.grad is not None]
    if any(isinstance(p.grad, DTensor) for p in params):  # tensor parallel
        from mesh3d.parallel.tensor import reduce_partial_grads

        reduce_partial_grads(params)
    grad_norm = clip_grad_norm(
        params, clip_grad, _counted_once(parts), pp_group if pp > 1 else None
    )
    loss = float(total)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)  # the non-finite guard
    committed = True if across is None else across.commit()
    if finite and committed and (accepts is None or accepts(loss, grad_norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if committed:
        scheduler.step()
    return loss, grad_norm


def total_params(parts: ModelParts, mesh) -> int:
    """Parameters of the whole model (all stages, full sizes of shards, a tied copy once)."""
    n = torch.tensor(sum(p.numel() * (getattr(p, "expert_shard", None) or (0, 0, 1))[2]
                         for p in _counted_once(parts, with_grad=False)))  # fmt: skip
    if mesh["pp"].size() > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n)


def _counted_once(parts: ModelParts, with_grad: bool = True) -> list[torch.nn.Parameter]:
    """Parameters for the norm, without a tied head that is a separate copy of the embedding."""
    ends = [e for e in map(tied_ends, parts.modules) if e is not None]
    skip = {
        id(h.weight) for e, h in ends if h is not None and (e is None or h.weight is not e.weight)
    }
    return [
        p for p in parts.parameters() if (p.grad is not None or not with_grad) and id(p) not in skip
    ]
