"""Checks of the optimizer and its learning-rate schedule; part of `validate` (no torch import)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from mesh3d.config.schema import AdamWOptimizerArgs, Config, MuonOptimizerArgs

LR = "optimizer.learning_rate_scheduler"


def optimizer_errors(cfg: Config) -> Iterator[str]:
    """`optimizer`: clipping, weight decay, ZeRO stage, Adam's settings, exclusion patterns."""
    o = cfg.optimizer
    if o.clip_grad is not None and o.clip_grad <= 0:
        yield f"`optimizer.clip_grad` must be > 0 or null (no clipping), got {o.clip_grad}"
    if o.weight_decay < 0:
        yield f"`optimizer.weight_decay` must be >= 0, got {o.weight_decay}"
    if o.zero_stage < 0:
        yield f"`optimizer.zero_stage` must be 0 (off) or 1 (ZeRO-1; Nanotron treats any value > 0 as 1), got {o.zero_stage}"
    f = o.optimizer_factory
    if isinstance(f, MuonOptimizerArgs):
        yield from _muon_errors(f)
    if isinstance(f, AdamWOptimizerArgs | MuonOptimizerArgs):
        for k in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(f, k) < 1:
                yield f"`optimizer.optimizer_factory.{k}` must be in [0, 1), got {getattr(f, k)}"
        if f.adam_eps < 0:
            yield f"`optimizer.optimizer_factory.adam_eps` must be >= 0, got {f.adam_eps}"
    yield from _patterns(
        "optimizer.weight_decay_exclude_named_params", o.weight_decay_exclude_named_params
    )


def lr_errors(cfg: Config) -> Iterator[str]:
    """`optimizer.learning_rate_scheduler` against `tokens.train_steps`."""
    s, steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    if s.learning_rate <= 0:
        yield f"`{LR}.learning_rate` must be > 0, got {s.learning_rate}"
    if s.lr_warmup_style not in ("linear", "constant"):
        yield f"`{LR}.lr_warmup_style` {s.lr_warmup_style!r} must be linear or constant"
    if s.lr_decay_style not in ("linear", "cosine", "1-sqrt"):
        yield f"`{LR}.lr_decay_style` {s.lr_decay_style!r} must be linear, cosine or 1-sqrt"
    if s.lr_warmup_steps < 0:
        yield f"`{LR}.lr_warmup_steps` must be >= 0, got {s.lr_warmup_steps}"
    if s.lr_decay_steps is not None and s.lr_decay_steps < 0:
        yield (
            f"`{LR}.lr_decay_steps` must be >= 0, got {s.lr_decay_steps} (when omitted it is "
            "tokens.train_steps - lr_warmup_steps)"
        )
    start = s.lr_warmup_steps if s.lr_decay_starting_step is None else s.lr_decay_starting_step
    # a warmup longer than the run, with no decay start, is a warning (`lr_warnings`)
    if (s.lr_decay_starting_step is not None or start <= steps) and not 0 <= start <= steps:
        yield f"`{LR}.lr_decay_starting_step` ({start}) must be in [0, tokens.train_steps ({steps})]"
    if not 0 <= s.min_decay_lr <= s.learning_rate:
        yield f"`{LR}.min_decay_lr` ({s.min_decay_lr}) must be in [0, learning_rate ({s.learning_rate})]"


def lr_warnings(cfg: Config) -> Iterator[str]:
    """A warmup longer than the run: accepted, but probably not meant."""
    s, steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    if s.lr_warmup_steps > steps > 0:
        reach = ""
        if s.lr_warmup_style == "linear":  # the last step uses lr(train_steps - 1)
            lr = s.learning_rate * (steps - 1) / s.lr_warmup_steps
            reach = f" and the learning rate reaches only {lr:.3g} (of {s.learning_rate:g})"
        yield (
            f"`{LR}.lr_warmup_steps` ({s.lr_warmup_steps}) is more than tokens.train_steps "
            f"({steps}): the whole run warms up{reach}, with no decay; lower lr_warmup_steps "
            "for the full schedule"
        )


def _muon_errors(f: MuonOptimizerArgs) -> Iterator[str]:
    """`name: muon`'s own keys (`train/muon.py`)."""
    key = "optimizer.optimizer_factory"
    if f.ns_dtype not in ("bfloat16", "float32"):
        yield f"`{key}.ns_dtype` {f.ns_dtype!r} is not one of bfloat16 (torch's Muon), float32"
    if f.adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        yield f"`{key}.adjust_lr_fn` {f.adjust_lr_fn!r} is not one of null, original, match_rms_adamw"
    if not 1 <= f.ns_steps < 100:
        yield f"`{key}.ns_steps` must be in [1, 99] (Newton-Schulz steps; torch's default 5), got {f.ns_steps}"
    if not 0 <= f.momentum < 1:
        yield f"`{key}.momentum` must be in [0, 1), got {f.momentum}"
    if len(f.ns_coefficients) != 3:
        yield f"`{key}.ns_coefficients` must be 3 numbers (a, b, c), got {f.ns_coefficients}"
    if not f.muon_params:
        yield f"`{key}.muon_params` is empty: name the 2-D weights Muon updates (re.match patterns), e.g. ['layers\\.\\d+\\..*weight$']"
    yield from _patterns(f"{key}.muon_params", f.muon_params)


def _patterns(key: str, patterns: list[str]) -> Iterator[str]:
    """A line for each of `patterns` (the list at `key`) that is not a regular expression."""
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as e:
            yield f"`{key}[{i}]` {pattern!r} is not a regular expression: {e}"
