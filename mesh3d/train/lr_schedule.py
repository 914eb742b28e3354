"""Nanotron's learning-rate schedule (docs/nanotron-layout.md#learning-rate-schedule), exactly:
optimizer step s (1-based) uses lr(s-1), so linear warmup's first update uses lr 0, and the `lr`
logged at step s is lr(s), the next step's."""

from __future__ import annotations

import math

import torch


def lr_at(k: int, learning_rate: float, warmup_steps: int, warmup_style: str, decay_style: str,
          decay_steps: int, decay_start: int | None, min_lr: float) -> float:  # fmt: skip
    """Learning rate at scheduler step `k` (0-based; optimizer step k+1 uses it)."""
    w, d = warmup_steps, decay_steps
    a = w if decay_start is None else decay_start
    if w == 0 and d == 0:
        return learning_rate
    if k <= w and warmup_style == "linear":
        return learning_rate * k / max(w, 1)
    if k <= w or k < a:  # constant warmup, or before the decay starts
        return learning_rate
    if k < a + d:
        t = (k - a) / d
        if decay_style == "cosine":
            return min_lr + (learning_rate - min_lr) * (1 + math.cos(math.pi * t)) / 2
        if decay_style == "linear":
            return min_lr + (learning_rate - min_lr) * (1 - t)
        if decay_style == "1-sqrt":
            return min_lr + (learning_rate - min_lr) * (1 - math.sqrt(t))
        raise ValueError(f"unknown lr_decay_style {decay_style!r}")
    return min_lr


def schedule_kwargs(cfg) -> dict:
    """The `lr_at` keyword arguments from a config's optimizer.learning_rate_scheduler."""
    s = cfg.optimizer.learning_rate_scheduler
    return dict(
        learning_rate=s.learning_rate,
        warmup_steps=s.lr_warmup_steps,
        warmup_style=s.lr_warmup_style or "linear",
        decay_style=s.lr_decay_style or "linear",
        decay_steps=s.lr_decay_steps,
        decay_start=s.lr_decay_starting_step,
        min_lr=s.learning_rate if s.min_decay_lr is None else s.min_decay_lr,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR giving each param group `lr_at(k)` with the group's own peak (its `lr`; µP
    scales it), all decaying to the same `min_decay_lr`, as Nanotron's per-group lambdas do."""
    kw = schedule_kwargs(cfg)

    def factor(peak: float):
        return lambda k: lr_at(k, **{**kw, "learning_rate": peak}) / peak

    lambdas = [factor(g["lr"]) for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
