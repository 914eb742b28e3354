"""Weights and optimizer state of any model, in Nanotron's layout (`training.py`, `any_model.py`).

`write_rank_state` gathers the full tensors of this rank's parameters one at a time
(collectives only among the ranks holding each) and writes its own (pp, tp) files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d import extensions
from mesh3d import nanotron_names as names
from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.finite import non_finite
from mesh3d.checkpoint.folder import FolderWriter
from mesh3d.checkpoint.nanotron_weights import Param, fuse, is_expert_stack, shard_of, weight_file
from mesh3d.errors import NonFiniteError
from mesh3d.log import Progress
from mesh3d.parallel.parallelize import canonical_name


@dataclass(frozen=True)
class Layout:
    """Sizes of the saving run and this rank's coordinates ({"pp", "dp", "cp", "tp"})."""

    dp: int
    tp: int
    pp: int
    coords: dict


def held_parameters(modules: Iterable[nn.Module]) -> dict[str, list[nn.Parameter]]:
    """Parameter name -> this rank's parameters holding it (a tied copy under its owner's name,
    from a module's `tied_parameters`)."""
    out: dict[str, list] = {}
    for m in modules:
        aliases = getattr(m, "tied_parameters", {})
        for name, p in m.named_parameters():
            name = canonical_name(name)
            out.setdefault(aliases.get(name, name), []).append(p)
    return out


def _full(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The full CPU tensor of `t` (a parameter, or an optimizer state of parameter `like`)."""
    shard = getattr(t if like is None else like, "expert_shard", None)
    t = t.detach()
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if shard is not None:
        t = extensions.load("expert_parallel").gather_expert_shard(t, shard)
    return t.cpu()


def _state_keys(optimizer, param) -> tuple[str, ...]:
    """The optimizer states of `param` a checkpoint keeps (AdamW's, or `state_keys`'s; maybe ())."""
    if isinstance(optimizer, torch.optim.AdamW):
        return nanotron_state.ADAM_KEYS
    keys_of = getattr(optimizer, "state_keys", None)
    return keys_of(param) if keys_of is not None else ()


def _group_hparams(group: dict) -> dict:
    """A parameter's group hyperparameters for Nanotron's one-group-per-parameter file. `lr` is
    the peak rate: Nanotron builds its LambdaLR with `initial_lr=group["lr"]` on resume, so a
    decayed lr would be decayed twice."""
    keys = ("weight_decay", "betas", "eps", "amsgrad", "foreach", "maximize", "capturable")
    keys += ("differentiable", "momentum", "dampening", "nesterov")
    keys += ("kind", "ns_steps", "ns_coefficients", "ns_eps", "ns_dtype", "adjust_lr_fn")  # Muon
    out = {k: group[k] for k in keys if k in group}
    peak = group.get("initial_lr", group["lr"])  # set by the LR scheduler at construction
    out.update(lr=peak, initial_lr=peak)
    if "fused" in group:
        out["fused"] = bool(group["fused"])  # None (torch's default) is not fused
    return out


def _finite(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t`, or a `NonFiniteError`: a checkpoint never holds NaN or inf."""
    if bad := non_finite(t):
        raise NonFiniteError(
            f"refusing to save: {what} holds {bad} NaN/inf value(s) of {t.numel()}; the "
            "checkpoint was not written and latest.txt still names the last finite one"
        )
    return t


def write_rank_state(writer: FolderWriter, params: list[Param], held: dict[str, list[nn.Parameter]],
                     optimizer: torch.optim.Optimizer | None, layout: Layout, *, zero: bool,
                     model_dtype: torch.dtype | None, masters: bool,
                     writes_weight: Callable[[Param], bool] = lambda p: True,
                     ep: int = 1) -> None:  # fmt: skip
    """This rank's weight, optimizer and random-state files. `params`: in the same order on
    every rank holding them; `writes_weight(p)` False for a tied copy another stage writes."""
    T, P, D = layout.coords["tp"], layout.coords["pp"], layout.coords["dp"]
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    # cp ranks hold their cp-0 rank's state (it alone writes), but join the gathers below
    writes = layout.coords.get("cp", 0) == 0
    entries, groups = [], []
    opt_state = optimizer.state if optimizer is not None else {}
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]} if optimizer else {}

    # Nanotron's loader wants a state entry for every name once there is any: a parameter
    # without state yet gets AdamW's fresh state (zeros, step 0), which updates like none.
    def keys_of(q) -> tuple[str, ...]:
        return _state_keys(optimizer, q) or nanotron_state.ADAM_KEYS

    any_state = any(k in opt_state.get(held[o][0], {}) for p in params for o in p.ours
                    for k in keys_of(held[o][0]))  # fmt: skip
    # a writer that checks every tensor itself (a background save's) spares this thread
    finite = (lambda t, what: t) if getattr(writer, "checks_finite", False) else _finite
    progress = Progress("Saving checkpoint (parameters of this rank)", len(params))
    # every state is gathered (collectives); those Nanotron lacks on this tp rank are not listed
    listed = {p.name for p in nanotron_state.tp_rank_entries(params, T)}
    for p in params:
        first = [held[o][0] for o in p.ours]
        fused = finite(fuse(p, {o: _full(q) for o, q in zip(p.ours, first)}), f"parameter {p.name}")
        if writes and D == 0 and (p.kind != "replicated" or T == 0) and writes_weight(p):
            data, meta = shard_of(p, fused.to(model_dtype or fused.dtype), T, tp)
            files = [(weight_file(p, T, tp, pp), slice(None))]
            if ep > 1 and is_expert_stack(p):  # one file per ep rank, Nanotron's exp-rank names
                files = extensions.load("expert_files").expert_files(p, ep, pp, tp)
            for rel, rows in files:
                body = {names.TENSOR_KEY: data[rows].contiguous()}
                writer.save_tensors(f"model/{rel}", body, meta)
        tensors = {nanotron_state.MASTER: fused.float()} if masters else {}
        state = opt_state.get(first[0], {})
        for k in keys_of(first[0]):
            if k in state:
                full = fuse(p, {o: _full(opt_state[q][k], q) for o, q in zip(p.ours, first)})
                tensors[k] = finite(full, f"optimizer state {k} of {p.name}")
            elif any_state:  # no state yet: a fresh state (zeros), in the parameter's dtype
                tensors[k] = torch.zeros_like(fused)
        local = {k: _own(shard_of(p, v, T, tp)[0]) for k, v in tensors.items()}
        if zero and local:
            a, b = nanotron_state.zero1_ranges(next(iter(local.values())).numel(), dp)[D]
            local = {k: v.reshape(-1)[a:b].clone() for k, v in local.items()}
        if "step" in state or any_state:
            local["step"] = state.get("step", torch.zeros(())).detach().cpu().clone()
        if p.name in listed:
            entries.append((p.name, local))
            groups.append(_group_hparams(group_of[first[0]]) if first[0] in group_of else {})
        progress.update()
    if writes and optimizer is not None and (zero or D == 0):
        name = nanotron_state.optimizer_file(P, pp, T, tp, *((D, dp) if zero else ()))
        writer.save_torch(f"optimizer/{name}", nanotron_state.optimizer_payload(entries, groups))
    if writes:
        rel = f"random/{nanotron_state.random_file(T, tp, D, dp, P, pp)}"
        writer.save_torch(rel, nanotron_state.random_states())
    progress.done()


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in a storage of its own size: `torch.save` writes a view's whole storage, and a
    vocab-parallel shard is a view of the full tensor."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
