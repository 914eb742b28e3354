"""Tensor parallelism: apply a plan `FQN pattern -> ParallelStyle` on mesh["tp"], and the
gradient fix-ups after backward. Plans live in each family's spec (`models/<family>_spec.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import parallelize_module

from mesh3d import tp_styles
from mesh3d.tp_styles import TPPlan


def shard_grads_like_params(model: nn.Module) -> None:
    """Give every tp-sharded parameter its gradient in the parameter's own layout.

    DTensor returns the vocab-parallel embedding's gradient as `Replicate()` (tp times the
    memory) while the weight is `Shard(0)`. Under FSDP these hooks never fire."""
    for p in model.parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            p.register_hook(functools.partial(_laid_out_as, tuple(p.placements)))


def _laid_out_as(placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    if (
        isinstance(grad, DTensor)
        and tuple(grad.placements) != placements
        and not any(isinstance(pl, Partial) for pl in grad.placements)  # those need a reduction
    ):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def reduce_partial_grads(params) -> None:
    """Turn `Partial` gradients (norm weights under sequence parallelism) into `Replicate` ones.

    Left partial, DTensor would reduce them on every read (clipping, AdamW); one flat all-reduce
    per (mesh, placements) group right after backward does it once.
    """
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(p)
    for (mesh, placements), ps in groups.items():
        locals_ = [p.grad.to_local() for p in ps]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if isinstance(pl, Partial):
                torch.distributed.all_reduce(flat, group=mesh.get_group(dim))
        done = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
        for p, t, local in zip(ps, locals_, flat.split([t.numel() for t in locals_])):
            local = local.view_as(t)
            p.grad = DTensor.from_local(
                local, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, strict: bool = True) -> nn.Module:
    """Apply `plan` (`FQN pattern -> ParallelStyle`) to `model` in place, without communication:
    every rank keeps its slice, so build the full model from the same seed on every rank first.

    Example:

        apply_tp(model, mesh["tp"], {"h.*.mlp.fc": ColwiseParallel(), "h.*.mlp.proj": RowwiseParallel()})

    Entries whose module is None are skipped; with `strict`, a key naming no module is refused.
    """
    tied = getattr(model, "lm_head", None) is not None and (
        getattr(model, "embed_tokens", None) is not None
        and model.lm_head.weight is model.embed_tokens.weight
    )
    if strict:
        from mesh3d.parallel.plan_keys import check_plan_keys  # a library caller's plan

        check_plan_keys(model, plan)
    if tp_mesh.ndim != 1:
        raise TypeError(f"apply_tp takes the mesh's tp axis, mesh['tp'], not {tp_mesh.ndim} axes")
    present = {k: v for k, v in plan.items() if _resolves(model, k)}
    parallelize_module(model, tp_mesh, present, src_data_rank=None)
    tp_styles.choose_collectives(tp_mesh.get_group(), tp_mesh.device_type)
    if tied:  # parallelizing the embedding and the head apart untied them
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _resolves(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` (fnmatch per dotted token) names at least one existing submodule."""
    from fnmatch import fnmatch

    tokens = pattern.split(".")
    for name, mod in model.named_modules():
        parts = name.split(".") if name else []
        if mod is not None and len(parts) == len(tokens) and all(map(fnmatch, parts, tokens)):
            return True
    return False
