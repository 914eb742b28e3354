"""Save a training checkpoint in Nanotron's layout and resume from it exactly, at any layout.

A step folder `<checkpoints_path>/<step>/` is Nanotron's (spec §3.1), and nothing else:
- `model/...`: weights in the model dtype, one safetensors file per parameter and TP rank;
- `optimizer/`: `optimizer_config.json` and one `optimizer_pp-*_tp-*_exp-0-of-1.pt` per (pp, tp)
  (ZeRO-0), or per (pp, dp, tp) with `zero_stage: 1`: AdamW state and the fp32 master weights
  (`gradient_accumulator`) when `accumulate_grad_in_fp32`;
- `lr_scheduler/lr_scheduler_pp-*_tp-*_exp-0-of-1.pt`, `random/tp-*_dp-*_pp-*.pt` (plain
  tensors, unlike Nanotron's pickled classes), `config.yaml`, `model_config.json`,
  `checkpoint_metadata.json` (mesh3d's additions under `custom_metas`).

Saving: each rank gathers the full tensors of the parameters it holds, one Nanotron parameter at
a time (collectives only within its pipeline stage), and writes the files of its own (pp, tp)
rank — dp rank 0 for weights and ZeRO-0 state, every dp rank for ZeRO-1 slices. Everything goes
into `.tmp-<step>/`, renamed into place when complete; `latest.txt` is replaced atomically last,
so a crash at any moment leaves the previous checkpoint as the one that loads.

Loading needs no collectives: each rank rebuilds the full tensors of its own parameters from the
files of whatever layout wrote them (weights, optimizer state — ZeRO-0 or ZeRO-1 — and masters)
and keeps its shard. So any (dp, tp, pp, zero_stage) resumes from any other, a different
vocabulary padding included, and checkpoints written by Nanotron itself load too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from mesh3d.checkpoint import names as N
from mesh3d.checkpoint import nanotron_state as S
from mesh3d.checkpoint.nanotron_weights import (
    ModelShape,
    Param,
    fuse,
    model_config_json,
    nanotron_params,
    read_param,
    shard_of,
    weight_file,
)
from mesh3d.config import global_batch_size, save_config
from mesh3d.data.stages import stage_consumption
from mesh3d.errors import UserError
from mesh3d.log import Progress, logger
from mesh3d.mesh import ParallelDims
from mesh3d.parallel.parallelize import canonical_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _held(parts) -> dict[str, list[torch.nn.Parameter]]:
    """Our parameter name -> this rank's parameters holding it (a tied head under the embedding)."""
    out: dict[str, list] = {}
    for m in parts.modules:
        aliases = getattr(m, "tied_parameters", {})
        for name, p in m.named_parameters():
            name = canonical_name(name)
            out.setdefault(aliases.get(name, name), []).append(p)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu()


def _my_params(shape: ModelShape, held: dict, pp: int) -> list[Param]:
    return [p for p in nanotron_params(shape, pp) if all(o in held for o in p.ours)]


def _group_hparams(optimizer) -> dict:
    g = optimizer.param_groups[0]
    keys = ("lr", "weight_decay", "betas", "eps", "amsgrad", "foreach", "maximize")
    keys += ("capturable", "differentiable", "fused", "momentum", "dampening", "nesterov")
    return {k: g[k] for k in keys if k in g}


def _writes_masters(cfg) -> bool:
    """fp32 master weights go to the optimizer files (Nanotron's `gradient_accumulator`) when
    they differ from the saved weights: fp32 accumulation with a bf16/fp16 model."""
    return cfg.optimizer.accumulate_grad_in_fp32 and cfg.model.dtype != "float32"


def _write_rank_files(tmp: Path, cfg, parts, optimizer, scheduler, coords: dict) -> None:
    """This rank's weight, optimizer, scheduler and random-state files (collectives inside)."""
    par = cfg.parallelism
    tp, pp, dp, zero = par.tp, par.pp, par.dp, cfg.optimizer.zero_stage > 0
    T, P, D = coords["tp"], coords["pp"], coords["dp"]
    shape, held = ModelShape.from_config(cfg), _held(parts)
    model_dtype = _DTYPES[cfg.model.dtype]
    masters = _writes_masters(cfg)
    entries, mine = [], _my_params(shape, held, pp)
    progress = Progress("Saving checkpoint (parameters of this rank)", len(mine))
    for p in mine:
        first = [held[o][0] for o in p.ours]
        fused = fuse(p, {o: _full(held[o][0]) for o in p.ours})
        writes_weight = D == 0 and (p.kind != "replicated" or T == 0)
        if p.name == N.EMBEDDING:
            writes_weight &= parts.embed_rank == P
        if writes_weight:
            data, meta = shard_of(p, fused.to(model_dtype), T, tp)
            path = tmp / "model" / weight_file(p, T, tp, pp)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({N.TENSOR_KEY: data}, str(path), metadata=meta or None)
        tensors = {S.MASTER: fused.float()} if masters else {}
        state = optimizer.state.get(first[0], {})
        for k in S.ADAM_KEYS:
            if k in state:
                tensors[k] = fuse(
                    p, {o: _full(optimizer.state[q][k]) for o, q in zip(p.ours, first)}
                )
        local = {k: shard_of(p, v, T, tp)[0] for k, v in tensors.items()}
        if zero:
            a, b = S.zero1_ranges(local[next(iter(local))].numel(), dp)[D] if local else (0, 0)
            local = {k: v.reshape(-1)[a:b].clone() for k, v in local.items()}
        if "step" in state:
            local["step"] = state["step"].detach().cpu().clone()
        entries.append((p.name, local))
        progress.update()
    if zero or D == 0:
        name = S.optimizer_file(P, pp, T, tp, *((D, dp) if zero else ()))
        torch.save(
            S.optimizer_payload(entries, _group_hparams(optimizer)), tmp / "optimizer" / name
        )
    if D == 0:
        torch.save(scheduler.state_dict(), tmp / "lr_scheduler" / S.lr_scheduler_file(P, pp, T, tp))
    torch.save(S.random_states(), tmp / "random" / S.random_file(T, tp, D, dp, P, pp))
    progress.done()


def _write_rank0_files(tmp: Path, cfg, step: int, consumed: int, extra: dict) -> None:
    par = cfg.parallelism
    shape = ModelShape.from_config(cfg)
    save_config(cfg, tmp / "config.yaml")
    (tmp / "model_config.json").write_text(json.dumps(model_config_json(cfg)))
    zero = cfg.optimizer.zero_stage > 0
    kind = "ZeroDistributedOptimizer" if zero else "NamedOptimizer"
    if not zero and _writes_masters(cfg):
        kind = "OptimizerFromGradientAccumulator"
    opt_cfg = S.optimizer_config(kind, par.tp, par.dp, par.pp, nanotron_params(shape), zero)
    (tmp / "optimizer" / "optimizer_config.json").write_text(json.dumps(opt_cfg))
    stages = cfg.data_stages or []
    starts = [s.start_training_step for s in stages] or [1]
    counts = stage_consumption(starts, step, global_batch_size(cfg))
    stage_meta = [
        {"name": s.name, "start_training_step": s.start_training_step, "consumed_train_samples": c}
        for s, c in zip(stages, counts)
    ]
    extra = {"writer": "mesh3d", "pp": par.pp, "zero_stage": cfg.optimizer.zero_stage, **extra}
    meta = S.metadata(par.tp, par.dp, step, consumed, stage_meta, extra)
    text = json.dumps(meta, indent=2, sort_keys=True)
    (tmp / "checkpoint_metadata.json").write_text(text)


def save_checkpoint(
    root: str | Path,
    step: int,
    cfg,
    parts,
    optimizer,
    scheduler,
    mesh,
    consumed_samples: int,
    extra: dict | None = None,
) -> Path:
    """Write `<root>/<step>/` (all ranks call this); returns the step folder.

    `extra` goes into the metadata's `custom_metas` (e.g. the W&B run id to continue).
    """
    root, rank = Path(root), dist.get_rank()
    final, tmp = root / str(step), root / f".tmp-{step}"
    logger.info(f"Saving checkpoint at {final}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in ("model", "optimizer", "lr_scheduler", "random"):
            (tmp / sub).mkdir(parents=True)
    dist.barrier()
    par = cfg.parallelism
    coords = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp).coords(rank)
    _write_rank_files(tmp, cfg, parts, optimizer, scheduler, coords)
    dist.barrier()
    if rank == 0:
        _write_rank0_files(tmp, cfg, step, consumed_samples, extra or {})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = root / ".latest.txt.tmp"
        latest.write_text(str(step))
        os.replace(latest, root / "latest.txt")
    dist.barrier()
    logger.info(f"Saved checkpoint {final}")
    return final


def resolve_step_dir(path: str | Path) -> Path:
    """A step folder, or a checkpoints root whose `latest.txt` names one."""
    path = Path(path)
    if (path / "checkpoint_metadata.json").exists():
        return path
    latest = path / "latest.txt"
    if latest.exists():
        step_dir = path / latest.read_text().strip()
        if (step_dir / "checkpoint_metadata.json").exists():
            return step_dir
        raise UserError(
            f"{latest} names step folder {step_dir}, which has no checkpoint_metadata.json"
        )
    raise UserError(
        f"`checkpoints.resume_checkpoint_path` {path} is neither a step folder (with "
        "checkpoint_metadata.json) nor a checkpoints folder with latest.txt"
    )


def checkpoint_custom_metas(path: str | Path) -> dict | None:
    """The `custom_metas` of the step folder `path` resolves to (None for Nanotron's)."""
    return S.read_metadata(resolve_step_dir(path)).get("custom_metas")


def _fit_rows(t: torch.Tensor, p: Param, rows: int) -> torch.Tensor:
    """Vocabulary tensors re-padded to `rows` (padding rows are zero and never trained)."""
    if p.kind != "vocab" or t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    n = min(rows, t.shape[0])
    out[:n] = t[:n]
    return out


def _place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, laid out like `like` (a DTensor or a plain tensor)."""
    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.clone()


def _assign(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` into `param` in place."""
    local = _place(full, param)
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(local)


def _load_scheduler(step_dir: Path, scheduler, optimizer, coords: dict, cfg) -> None:
    folder = step_dir / "lr_scheduler"
    par = cfg.parallelism
    mine = folder / S.lr_scheduler_file(coords["pp"], par.pp, coords["tp"], par.tp)
    files = [mine] if mine.is_file() else sorted(folder.glob("lr_scheduler*.pt"))
    if not files:
        raise UserError(
            f"{folder} has no lr_scheduler_*.pt file; resume with "
            "checkpoints.load_lr_scheduler: false to restart the schedule"
        )
    k = int(S.safe_load(files[0], "LR scheduler")["last_epoch"])
    scheduler.last_epoch, scheduler._step_count = k, k + 1
    lrs = [base * f(k) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def load_checkpoint(path: str | Path, parts, optimizer, scheduler, cfg,
                    load_optimizer: bool = True, load_lr_scheduler: bool = True,
                    ) -> tuple[int, int]:  # fmt: skip
    """Load weights (and optimizer/scheduler state) into this rank's parts, at any layout.

    Returns (last_train_step, consumed_train_samples); (0, 0) when `load_lr_scheduler` is
    false, as in Nanotron (the metadata goes with the scheduler).
    """
    step_dir = resolve_step_dir(path)
    meta = S.read_metadata(step_dir)
    saved = json.loads((step_dir / "model_config.json").read_text())
    shape = ModelShape.from_config(cfg)
    saved_shape = dataclasses.replace(shape, padded_vocab=int(saved["vocab_size"]))
    held = _held(parts)
    files = S.OptimizerFiles(step_dir / "optimizer") if load_optimizer else None
    adam = isinstance(optimizer, torch.optim.AdamW)
    mine = _my_params(saved_shape, held, 1)
    progress = Progress(f"Loading checkpoint {step_dir}", len(mine))
    for p in mine:
        master = files.full(p, S.MASTER) if files is not None and files.has_master else None
        weights = master if master is not None else read_param(step_dir / "model", p)
        states, step = {}, None
        if files is not None and adam:
            states = {k: files.full(p, k) for k in S.ADAM_KEYS}
            states = {k: v for k, v in states.items() if v is not None}
            step = files.step(p)
        for i, o in enumerate(p.ours):
            ours = {k: _fit_rows(torch.split(v, p.chunks)[i], p, shape.padded_vocab)
                    for k, v in {"weight": weights, **states}.items()}  # fmt: skip
            for q in held[o]:
                _assign(q, ours["weight"])
                if states:
                    optimizer.state[q] = {k: _place(ours[k], q) for k in states}
                    optimizer.state[q]["step"] = (
                        torch.zeros(()) if step is None else step.float().clone()
                    )
        progress.update()
    progress.done()
    rank = dist.get_rank() if dist.is_initialized() else 0
    par = cfg.parallelism
    coords = ParallelDims(dp=par.dp, tp=par.tp, pp=par.pp).coords(rank)
    custom = meta.get("custom_metas") or {}
    same_layout = (meta["tp"], meta["dp"], custom.get("pp")) == (par.tp, par.dp, par.pp)
    rng = step_dir / "random" / S.random_file(coords["tp"], par.tp, coords["dp"], par.dp,
                                              coords["pp"], par.pp)  # fmt: skip
    if custom.get("writer") == "mesh3d" and same_layout and rng.is_file():
        S.set_random_states(S.safe_load(rng, "random-state"))  # Nanotron's are pickled classes
    if not load_lr_scheduler:
        return 0, 0
    _load_scheduler(step_dir, scheduler, optimizer, coords, cfg)
    metas = meta["metas"]
    return int(metas["last_train_step"]), int(metas["consumed_train_samples"])
