"""Mixture-of-experts bookkeeping of a training run: the auxiliary loss's weight in backward and
the per-step metrics (`moe_aux_loss`, `moe_load_max`).

The MoE blocks (`models/moe.py`) add their load-balancing gradient themselves; training only
sets its weight, router_aux_loss_coef / (MoE layers · sequences in the global batch), times the
layout's `backward_scale` (FSDP averages gradients over dp x cp), so summing every sequence,
layer and rank gives the coefficient times the mean over sequences and MoE layers, at any layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mesh3d.mesh import groups_of


def moe_blocks(modules, layout) -> list:
    """The MoE blocks (the family spec's `blocks().moe` classes) of `modules`."""
    moe = layout.spec.blocks().moe
    return [m for module in modules for m in module.modules() if isinstance(m, moe)]


def set_aux_weights(modules, layout) -> None:
    """The backward weight of every MoE block's auxiliary loss (module doc)."""
    for block in moe_blocks(modules, layout):
        block.aux_weight = (
            block.aux_coef / (block.num_moe_layers * layout.global_batch) * layout.backward_scale
        )


def clear_stats(modules, layout) -> None:
    for block in moe_blocks(modules, layout):
        block.stats.clear()


def step_metrics_of(run) -> Callable[[], dict[str, float]]:
    """`step_metrics` of a training run's model (`Run.step_metric_sources`)."""
    g = groups_of(run.mesh)
    tp = g.tp if run.layout.sequence_parallel else None
    return lambda: step_metrics(run.parts.modules, run.layout, g.replicas, g.pp, run.device, tp)


def step_metrics(
    modules, layout, replica_group, pp_group, device, tp_group=None
) -> dict[str, float]:
    """{"moe_aux_loss", "moe_load_max"} of the step just run, the same on every rank (call on
    every rank): the auxiliary loss (coefficient included) and, over MoE layers, the largest
    ratio of an expert's tokens to the mean tokens per expert (1: balanced). Empties the stats.
    `tp_group`: under sequence parallelism each tp rank saw its own tokens; they are summed."""
    blocks = moe_blocks(modules, layout)
    aux = torch.zeros((), dtype=torch.float64, device=device)
    counts = []
    for block in blocks:
        if block.stats:
            aux += (
                sum(a.double() for a, _ in block.stats)
                * block.aux_coef
                / (block.num_moe_layers * layout.global_batch)
            )
            counts.append(torch.stack([c for _, c in block.stats]).sum(0).double())
        block.stats.clear()
    load = (
        torch.stack(counts) if counts else torch.zeros((0, 1), dtype=torch.float64, device=device)
    )
    for group in (replica_group, tp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(aux, group=group)
            if counts:
                dist.all_reduce(load, group=group)
    worst = (
        (load.max(1).values / load.mean(1).clamp_min(1e-12)).max() if counts else torch.zeros(())
    )
    worst = worst.to(device=device, dtype=torch.float64)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(aux, group=pp_group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp_group)
    return {"moe_aux_loss": float(aux), "moe_load_max": float(worst)}
