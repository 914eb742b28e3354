"""Save a training checkpoint and resume from it, exactly, at the same or another layout.

A step folder `<checkpoints_path>/<step>/` holds:
- `model/...`: the weights in Nanotron's layout (written at the run's tp/pp; readable by
  Nanotron and by `read_nanotron_weights` at any layout);
- `mesh3d/`: the resumable state — every parameter and its optimizer state, keyed by the
  parameter's name in the full model — as a torch Distributed Checkpoint, which reshards on
  load, so a checkpoint saved at one (dp, tp, pp, zero_stage) loads at any other;
- `lr_scheduler/lr_scheduler.pt` (plain values; `weights_only` loadable), `config.yaml`,
  `model_config.json`, `checkpoint_metadata.json` (last step, consumed samples).
It is written into a temporary folder that is renamed into place when complete; `latest.txt`
is replaced atomically last. A crash at any moment leaves the previous checkpoint intact.
The data position needs no state of its own: dummy data is indexed by global sample, so the
consumed-sample count is the position. Training uses no random numbers after init.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.nanotron_weights import ModelShape, model_config_json, write_nanotron_weights
from mesh3d.config import save_config
from mesh3d.errors import UserError
from mesh3d.log import logger
from mesh3d.parallel.parallelize import canonical_name

CHECKPOINT_VERSION = "1.4"


def _owners(parts) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of this rank, a tied head copy named after the embedding it mirrors."""
    out = []
    for m in parts.modules:
        aliases = getattr(m, "tied_parameters", {})
        for name, p in m.named_parameters():
            name = canonical_name(name)
            out.append((aliases.get(name, name), p))
    return out


def _state(parts, optimizer: torch.optim.Optimizer, for_load: bool) -> tuple[dict, list]:
    """The DCP state dict of this rank and, for loading, the tied copies to fill afterwards."""
    state, copies, owner = {}, [], {}
    for name, p in _owners(parts):
        key = f"model/{name}"
        if key in state:  # a tied copy on the same rank as its owner (V placement)
            copies.append((owner[key], p))
            continue
        state[key], owner[key] = p.detach(), p
        if for_load and p not in optimizer.state and isinstance(optimizer, torch.optim.AdamW):
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p.detach()),
                "exp_avg_sq": torch.zeros_like(p.detach()),
            }
        for k, v in optimizer.state.get(p, {}).items():
            state[f"optim/{name}/{k}"] = v
    return state, copies


def _full_weights(parts, mesh) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (all stages) on every rank — collectives on all ranks."""
    full = {}
    for name, p in _owners(parts):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        full.setdefault(name, t.detach().float().cpu())
    if mesh["pp"].size() > 1:
        gathered = [None] * mesh["pp"].size()
        dist.all_gather_object(gathered, full, group=mesh["pp"].get_group())
        full = {k: v for g in gathered for k, v in g.items()}
    return full


def save_checkpoint(
    root: str | Path, step: int, cfg, parts, optimizer, scheduler, mesh, consumed_samples: int
) -> Path:
    """Write `<root>/<step>/` (all ranks call this); returns the step folder."""
    root, rank = Path(root), dist.get_rank()
    final, tmp = root / str(step), root / f".tmp-{step}"
    logger.info(f"Saving checkpoint at {final}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state, _ = _state(parts, optimizer, for_load=False)
    dcp.save(state, checkpoint_id=str(tmp / "mesh3d"))
    full = _full_weights(parts, mesh)
    if rank == 0:
        shape = ModelShape.from_config(cfg)
        p = cfg.parallelism
        write_nanotron_weights(tmp / "model", full, shape, tp=p.tp, pp=p.pp)
        (tmp / "lr_scheduler").mkdir()
        torch.save(scheduler.state_dict(), tmp / "lr_scheduler" / "lr_scheduler.pt")
        save_config(cfg, tmp / "config.yaml")
        (tmp / "model_config.json").write_text(json.dumps(model_config_json(cfg), indent=2))
        meta = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "tp": p.tp,
            "dp": p.dp,
            "metas": {"last_train_step": step, "consumed_train_samples": consumed_samples},
        }
        (tmp / "checkpoint_metadata.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = root / ".latest.txt.tmp"
        latest.write_text(str(step))
        os.replace(latest, root / "latest.txt")
    dist.barrier()
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


def load_checkpoint(path: str | Path, parts, optimizer, scheduler, padded_vocab: int,
                    load_optimizer: bool = True, load_lr_scheduler: bool = True,
                    ) -> tuple[int, int]:  # fmt: skip
    """Load weights (and optimizer/scheduler state) into this rank's parts, at any layout.

    Returns (last_train_step, consumed_train_samples); (0, 0) when `load_lr_scheduler` is
    false, as in Nanotron (the metadata goes with the scheduler).
    """
    step_dir = resolve_step_dir(path)
    if not (step_dir / "mesh3d").is_dir():
        raise UserError(
            f"{step_dir} has no mesh3d/ state folder: resuming a checkpoint written by Nanotron "
            "itself is not supported by mesh3d yet"
        )
    saved_vocab = json.loads((step_dir / "model_config.json").read_text())["vocab_size"]
    if saved_vocab != padded_vocab:
        raise UserError(
            f"{step_dir} was saved with a padded vocabulary of {saved_vocab} rows, this layout pads "
            f"to {padded_vocab} (model.make_vocab_size_divisible_by x parallelism.tp); resuming "
            "across a change of vocabulary padding is not supported by mesh3d yet: pick a tp / "
            "make_vocab_size_divisible_by that pads to the same size"
        )
    state, copies = _state(parts, optimizer, for_load=load_optimizer)
    if not load_optimizer:
        state = {k: v for k, v in state.items() if k.startswith("model/")}
    dcp.load(state, checkpoint_id=str(step_dir / "mesh3d"))
    with torch.no_grad():
        for src, dst in copies:
            dst.copy_(src)
            if src in optimizer.state:
                optimizer.state[dst] = {k: v.clone() for k, v in optimizer.state[src].items()}
    if not load_lr_scheduler:
        return 0, 0
    sd = torch.load(step_dir / "lr_scheduler" / "lr_scheduler.pt", weights_only=True)
    scheduler.load_state_dict(sd)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # load_state_dict restores the schedule, not the optimizer's rates
    metas = json.loads((step_dir / "checkpoint_metadata.json").read_text())["metas"]
    return int(metas["last_train_step"]), int(metas["consumed_train_samples"])
