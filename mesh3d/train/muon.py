"""Muon on the decoder layers' 2-D weights and AdamW on the rest, at every layout.

`optimizer.optimizer_factory: {name: muon, ...}` (`config/schema.py` `MuonOptimizerArgs`). A
parameter whose name `re.match`es one of `muon_params` (default: every decoder layer's weight)
and that is 2-D gets Muon; embeddings, the lm_head, norms, biases and 3-D expert stacks get
AdamW. One optimizer holds both kinds of group (`kind`), so the LR schedule, clipping and
checkpoints treat it as any other.

Muon is torch's (`torch.optim.Muon`, same math, same order of operations): momentum
`buf.lerp_(g, 1 - mu)`, Nesterov `g.lerp(buf, mu)`, `ns_steps` quintic Newton-Schulz steps in
`ns_dtype` on the matrix scaled to unit Frobenius norm (transposed when taller than wide),
decoupled weight decay, and the rate adjusted by `adjust_lr_fn` from the full shape. The AdamW
part is torch's single-tensor AdamW. On one process the two equal `torch.optim.Muon` +
`torch.optim.AdamW(foreach=False)` bitwise (`tests/unit/test_muon.py`).

Layouts. Newton-Schulz needs the whole matrix, which a tp shard or a ZeRO-1 / full-shard slice
is not: the Nesterov update of a sharded parameter (a DTensor) is gathered (`full_tensor`: one
all-gather over the mesh dimensions it is sharded on), every rank that holds a piece
orthogonalizes the whole matrix, and keeps its own piece of the result (no second collective).
The gather costs one parameter's size per matrix a step; the redundant Newton-Schulz costs
5 x 3 matmuls of the matrix per holder. With `ns_dtype: float32` every layout equals one
process within 1e-5 (`tests/ranks/test_muon_ranks.py`); with torch's bfloat16, roundings that
tiny layout differences flip make layouts agree to about 1e-3 instead.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from mesh3d.errors import UserError

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def orthogonalize(g: Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> Tensor:
    """The quintic Newton-Schulz iteration of torch's Muon on the matrix `g`, in `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, fn: str | None, shape) -> float:
    """torch's Muon rate adjustment from the parameter's full shape (A, B)."""
    rows, cols = shape[:2]
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(full: Tensor, ref: Tensor) -> Tensor:
    """`full` cut as `ref` is (this rank's piece of a DTensor; `full` itself otherwise)."""
    if not isinstance(ref, DTensor):
        return full
    return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """Groups with `kind` "muon" (2-D weights) or "adamw" (the rest); see the module doc."""

    def __init__(self, groups: list[dict], lr: float, f):
        defaults = dict(lr=lr, weight_decay=0.0, kind="adamw", betas=(f.adam_beta1, f.adam_beta2),
                        eps=f.adam_eps, momentum=f.momentum, nesterov=f.nesterov,
                        ns_steps=f.ns_steps, ns_coefficients=tuple(f.ns_coefficients),
                        ns_eps=f.eps, ns_dtype=f.ns_dtype, adjust_lr_fn=f.adjust_lr_fn)  # fmt: skip
        super().__init__(groups, defaults)

    def state_keys(self, p: Tensor) -> tuple[str, ...]:
        """The states of `p` a checkpoint holds (`checkpoint/load.py` restores them)."""
        kind = next(g["kind"] for g in self.param_groups if any(q is p for q in g["params"]))
        return ("momentum_buffer",) if kind == "muon" else ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["kind"] == "muon" else self._adamw)(p, group)
        return loss

    def _muon(self, p: Tensor, group: dict) -> None:
        state, g = self.state[p], p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.lerp_(g, 1 - mu)
        update = g.lerp(buf, mu) if group["nesterov"] else buf
        full = orthogonalize(_whole(update), group["ns_coefficients"], group["ns_steps"],
                             group["ns_eps"], _DTYPES[group["ns_dtype"]])  # fmt: skip
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(_like(full.to(p.dtype), p),
               alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))  # fmt: skip

    def _adamw(self, p: Tensor, group: dict) -> None:
        state, g = self.state[p], p.grad
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        state["step"] += 1
        step = float(state["step"])
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-step_size)


def split_groups(groups: list[dict], names: dict[int, str], patterns: list[str],
                 explicit: bool = False) -> list[dict]:  # fmt: skip
    """Each of `groups` (param_groups' dicts) cut into its Muon part (2-D parameters whose name,
    `names[id(p)]`, matches a pattern) and its AdamW part; empty parts dropped. A pattern that
    matches no parameter, or (`explicit`: the user's patterns) matches one that is not 2-D, is
    a `UserError`."""
    matched: set[str] = set()
    for g in groups:
        for p in g["params"]:
            for pat in patterns:
                if re.match(pat, names[id(p)]):
                    matched.add(pat)
                    if explicit and p.ndim != 2:
                        raise UserError(
                            f"`optimizer.optimizer_factory.muon_params` {pat!r} matches "
                            f"{names[id(p)]} of shape {list(p.shape)}: Muon orthogonalizes "
                            "2-D matrices only; narrow the pattern (e.g. end it with weight$)"
                        )
    unmatched = [pat for pat in patterns if pat not in matched]
    if unmatched:
        some = ", ".join(sorted(names.values())[:4])
        raise UserError(
            f"`optimizer.optimizer_factory.muon_params` {unmatched} match(es) no parameter of "
            f"this model (its names look like {some}, ...): fix the pattern(s)"
        )
    out = []
    for g in groups:
        muon = [
            p
            for p in g["params"]
            if p.ndim == 2 and any(re.match(pat, names[id(p)]) for pat in patterns)
        ]
        ids = {id(p) for p in muon}
        rest = [p for p in g["params"] if id(p) not in ids]
        for kind, params in (("muon", muon), ("adamw", rest)):
            if params:
                out.append({**g, "params": params, "kind": kind})
    return out
