"""Save a training checkpoint in Nanotron's layout and resume from it exactly, at any layout.

A step folder is Nanotron's (docs/nanotron-layout.md#the-step-folder) plus what Nanotron
ignores (`mesh3d_manifest.json`, `tokenizer/`, `data/`). Each rank gathers the full tensors of
its parameters and writes its own (pp, tp) files; `atomic.py` makes the save all-or-nothing.
Loading (`load.py`) rebuilds each rank's parameters from whatever layout wrote the files, so any
(dp, tp, pp, zero_stage) and vocabulary padding resumes from any other, Nanotron's included.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from mesh3d import extensions
from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.atomic import save_atomically
from mesh3d.checkpoint.folder import FolderWriter, fsync_dir
from mesh3d.checkpoint.nanotron_weights import is_embedding, model_config_json, nanotron_params
from mesh3d.checkpoint.size import checkpoint_size
from mesh3d.checkpoint.state import Layout, held_parameters, write_rank_state
from mesh3d.checkpoint.tokenizer_files import copy_into_checkpoint
from mesh3d.config.load import mesh3d_changes, nanotron_config_yaml
from mesh3d.data.stages import stage_consumption
from mesh3d.errors import UserError
from mesh3d.layout import RunLayout
from mesh3d.log import logger
from mesh3d.mesh import collective_timeout


def _rank_params(layout: RunLayout, parts, pp_rank: int, held: dict) -> list:
    """The Nanotron parameters this rank holds, in the order of Nanotron's optimizer files
    (its loader pairs states by position): a tied lm_head on another stage than the embedding
    comes last, under the embedding's name. A LoRA run's: its adapters."""
    if parts.params_of is not None:  # a transformers model: its own names
        return parts.params_of(pp_rank)
    if layout.lora is not None:
        return extensions.load("lora_files").adapter_params(layout.lora, pp_rank, held)
    params = [p for p in nanotron_params(layout.shape, layout.dims.pp)
              if all(o in held for o in p.ours)]  # fmt: skip
    if parts.embed_rank != pp_rank:  # at most the tied lm_head copy is named like the embedding
        params.sort(key=is_embedding)  # stable: the rest keep their order
    return params


def _zero_files(cfg) -> bool:
    """Optimizer files in Nanotron's ZeRO-1 form (a transformers model's: whole, ZeRO-0)."""
    return cfg.optimizer.zero_stage > 0 and not cfg.mesh3d.hf_model


def data_state_file(dp_rank: int, dp: int) -> str:
    """Where a step folder keeps dp rank `dp_rank`'s streamed-data position (mesh3d's own)."""
    return f"data/stream_dp-{dp_rank}-of-{dp}.pt"


def _write_rank_files(writer: FolderWriter, cfg, parts, optimizer, scheduler,
                      layout: RunLayout, data_state: dict | None = None) -> None:  # fmt: skip
    """This rank's weight, optimizer, scheduler and random-state files (collectives inside),
    and `data_state`, its dp rank's stream position, when it has one to write."""
    par, coords = cfg.parallelism, layout.coords
    if data_state is not None:
        writer.save_torch(data_state_file(coords["dp"], par.dp), data_state)
    P, held = coords["pp"], held_parameters(parts.modules)
    params = _rank_params(layout, parts, P, held)
    write_rank_state(
        writer, params, held, optimizer,
        Layout(par.dp, par.tp, par.pp, coords), zero=_zero_files(cfg),
        model_dtype=layout.model_dtype, masters=layout.fp32_masters,
        writes_weight=lambda p: not is_embedding(p) or parts.embed_rank == P,
        ep=par.expert_parallel_size,
    )  # fmt: skip
    if coords["dp"] == 0 and coords.get("cp", 0) == 0:
        # Nanotron's shape: one entry per parameter of this (pp, tp) rank's optimizer file
        # (every parameter for ZeRO-1, whose files keep empty groups), peak lr as base
        name = nanotron_state.lr_scheduler_file(P, par.pp, coords["tp"], par.tp)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        listed = nanotron_state.tp_rank_entries(params, coords["tp"])
        groups = [group_of[id(held[p.ours[0]][0])] for p in listed]
        state = nanotron_state.lr_scheduler_state(
            [g["initial_lr"] for g in groups], [g["lr"] for g in groups], scheduler.last_epoch
        )
        writer.save_torch(f"lr_scheduler/{name}", state)


def _write_rank0_files(writer: FolderWriter, cfg, layout: RunLayout, step: int, consumed: int,
                       extra: dict) -> None:  # fmt: skip
    par = cfg.parallelism
    writer.write_text("config.yaml", nanotron_config_yaml(cfg, step, consumed))
    writer.write_text("model_config.json", json.dumps(model_config_json(cfg)))
    zero = _zero_files(cfg)
    plain = "OptimizerFromGradientAccumulator" if layout.fp32_masters else "NamedOptimizer"
    kind = "ZeroDistributedOptimizer" if zero else plain
    lora = extensions.load("lora_files") if layout.lora is not None else None
    saved = nanotron_params(layout.shape) if lora is None else lora.adapter_params(layout.lora)
    opt_cfg = nanotron_state.optimizer_config(kind, par.tp, par.dp, par.pp, saved, zero)
    if lora is not None:  # what the adapters are and the base they apply to
        extra = {**extra, "lora": lora.lora_meta(cfg, layout.lora)}
    writer.write_text("optimizer/optimizer_config.json", json.dumps(opt_cfg))
    stages = cfg.data_stages or []
    starts = [s.start_training_step for s in stages] or [1]
    counts = stage_consumption(starts, step, layout.global_batch)
    stage_meta = [
        {"name": s.name, "start_training_step": s.start_training_step, "consumed_train_samples": c,
         "sequence_length": s.sequence_length or cfg.tokens.sequence_length,
         "consumed_tokens_per_dataset_folder": {}}
        for s, c in zip(stages, counts)
    ]  # fmt: skip
    extra = {"writer": "mesh3d", "pp": par.pp, "zero_stage": cfg.optimizer.zero_stage, **extra}
    if changes := mesh3d_changes(cfg):  # config.yaml leaves `mesh3d:` out (Nanotron refuses it)
        extra["mesh3d"] = changes
    meta = nanotron_state.metadata(par.tp, par.dp, step, consumed, stage_meta, extra,
                                   cp=par.context_parallel_size)  # fmt: skip
    writer.write_text("checkpoint_metadata.json", json.dumps(meta, indent=2, sort_keys=True))
    copy_into_checkpoint(writer, cfg.tokenizer.tokenizer_name_or_path if cfg.tokenizer else None)


def save_checkpoint(root: str | Path, step: int, cfg, parts, optimizer, scheduler, mesh,
                    consumed_samples: int, *, layout: RunLayout, extra: dict | None = None,
                    latest: bool = True, background: bool = False,
                    data_state: dict | None = None) -> Path | object:  # fmt: skip
    """Write `<root>/<step>/` (all ranks call this); returns the step folder, or with
    `background` the `async_save.PendingSave`. `extra` goes into `custom_metas`; `latest` False
    leaves `latest.txt` as it is; a failed save raises on every rank, the folder as it was."""
    final = Path(root) / str(step)
    data_bytes, files = checkpoint_size(cfg, layout)
    logger.info(f"Saving checkpoint at {final}" + (" (in the background)" if background else ""))
    save = save_atomically
    if background:  # `mesh3d.async_checkpoint`: loaded only when it is on
        async_save = extensions.load("async_checkpoint")
        live = async_save.live_storages(parts.modules, optimizer)
        save = functools.partial(async_save.start_save, live=live)
    with collective_timeout(mesh, cfg.mesh3d.checkpoint_timeout_s, cfg.mesh3d.collective_timeout_s):
        out = save(
            final,
            lambda w: _write_rank_files(w, cfg, parts, optimizer, scheduler, layout, data_state),
            lambda w: _write_rank0_files(w, cfg, layout, step, consumed_samples, extra or {}),
            needed_bytes=data_bytes,
            needed_files=files,
            step=step,
            latest=latest,
        )
    if not background:
        logger.info(f"Saved checkpoint {final}")
    return out


def resolve_step_dir(path: str | Path, key: str = "`checkpoints.resume_checkpoint_path`") -> Path:
    """A step folder, or a checkpoints root whose `latest.txt` names one; `key` names the
    setting or flag that gave `path`, in the error."""
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
    hf = (path / "config.json").is_file()  # a Hugging Face model folder: convert it first
    raise UserError(
        f"{key} {path} is neither a step folder (with "
        "checkpoint_metadata.json) nor a checkpoints folder with latest.txt"
        + (f"; it is a Hugging Face model folder: mesh3d convert from-hf --model {path} "
           "--output FOLDER writes one mesh3d reads" if hf else "")
    )  # fmt: skip


def add_custom_metas(step_dir: Path, extra: dict) -> None:
    """Add `extra` to a saved step folder's `custom_metas`, atomically (outside the manifest)."""
    path = step_dir / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    meta["custom_metas"] = {**(meta.get("custom_metas") or {}), **extra}
    tmp = f".{path.name}.tmp"
    FolderWriter(step_dir).write_text(tmp, json.dumps(meta, indent=2, sort_keys=True))
    os.replace(step_dir / tmp, path)
    fsync_dir(step_dir)


def lora_of(folder: Path) -> dict | None:
    """The `lora` entry of a step folder's metadata (a LoRA run's checkpoint), else None."""
    try:
        meta = json.loads((folder / "checkpoint_metadata.json").read_text())
    except (OSError, ValueError):
        return None
    return (meta.get("custom_metas") or {}).get("lora") if isinstance(meta, dict) else None
