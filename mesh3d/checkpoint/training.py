"""Save a training checkpoint in Nanotron's layout and resume from it exactly, at any layout.

A step folder is Nanotron's (docs/nanotron-layout.md#the-step-folder) plus what Nanotron
ignores (`mesh3d_manifest.json`, `tokenizer/`, `data/`). Each rank gathers the full tensors of
its parameters and writes its own (pp, tp) files; `atomic.py` makes the save all-or-nothing.
Collectives run under `mesh3d.checkpoint_timeout_s`. Loading verifies the manifest (spread over
the ranks), then each rank rebuilds its parameters from whatever layout wrote the files, so any
(dp, tp, pp, zero_stage) and vocabulary padding resumes from any other, Nanotron's included.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

from mesh3d import extensions
from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.atomic import _everyone, _rank_world, save_atomically
from mesh3d.checkpoint.folder import MANIFEST, FolderWriter, damaged_error, fsync_dir, verify
from mesh3d.checkpoint.nanotron_weights import is_embedding, model_config_json, nanotron_params
from mesh3d.checkpoint.size import checkpoint_size
from mesh3d.checkpoint.state import Layout, held_parameters, load_rank_state, write_rank_state
from mesh3d.checkpoint.tokenizer_files import copy_into_checkpoint
from mesh3d.config.load import mesh3d_changes, nanotron_config_yaml
from mesh3d.data.stages import stage_consumption
from mesh3d.errors import UserError, on_every_rank
from mesh3d.layout import RunLayout
from mesh3d.log import logger
from mesh3d.mesh import collective_timeout
from mesh3d.torch_private import set_scheduler_position


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
    kind = "ZeroDistributedOptimizer" if zero else "NamedOptimizer"
    if not zero and layout.fp32_masters:
        kind = "OptimizerFromGradientAccumulator"
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


def weights_dir(path: str | Path, key: str) -> Path:
    """A folder of weights to read (not resume): one with `model_config.json` (a step folder,
    or what `from-hf` writes), else the step folder `resolve_step_dir` finds."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{key} {path} does not exist; give a step folder or a checkpoints folder")
    return path if (path / "model_config.json").is_file() else resolve_step_dir(path, key)


def add_custom_metas(step_dir: Path, extra: dict) -> None:
    """Add `extra` to the `custom_metas` of a saved step folder's metadata, replaced atomically
    (the file is outside the manifest)."""
    path = step_dir / "checkpoint_metadata.json"
    meta = json.loads(path.read_text())
    meta["custom_metas"] = {**(meta.get("custom_metas") or {}), **extra}
    FolderWriter(step_dir).write_text(
        f".{path.name}.tmp", json.dumps(meta, indent=2, sort_keys=True)
    )
    os.replace(step_dir / f".{path.name}.tmp", path)
    fsync_dir(step_dir)


def load_data_state(path: str | Path) -> list[dict]:
    """The streamed-data positions a checkpoint saved, one per dp rank it was saved with."""
    files = sorted((resolve_step_dir(path) / "data").glob("stream_dp-*.pt"))
    return [nanotron_state.safe_load(f, "streamed-data position") for f in files]


def checkpoint_custom_metas(path: str | Path) -> dict | None:
    """The `custom_metas` of the step folder `path` resolves to (None for Nanotron's)."""
    return nanotron_state.read_metadata(resolve_step_dir(path)).get("custom_metas")


def _load_scheduler(step_dir: Path, scheduler, optimizer, layout: RunLayout) -> None:
    folder = step_dir / "lr_scheduler"
    par, coords = layout.dims, layout.coords
    mine = folder / nanotron_state.lr_scheduler_file(coords["pp"], par.pp, coords["tp"], par.tp)
    files = [mine] if mine.is_file() else sorted(folder.glob("lr_scheduler*.pt"))
    if not files:
        raise UserError(
            f"{folder} has no lr_scheduler_*.pt file; resume with "
            "checkpoints.load_lr_scheduler: false to restart the schedule"
        )
    k = int(nanotron_state.safe_load(files[0], "LR scheduler")["last_epoch"])
    scheduler.last_epoch = k
    lrs = [base * f(k) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    set_scheduler_position(scheduler, k + 1, lrs)


def verify_everywhere(step_dir: Path, meta: dict, unverified_ok: bool = False) -> None:
    """Check the manifest's checksums, the files spread over the ranks; every rank raises the
    same `UserError`. Without a manifest: passes when Nanotron wrote the folder, else refused
    unless `unverified_ok`."""
    if not (step_dir / MANIFEST).is_file():
        if (meta.get("custom_metas") or {}).get("writer") != "mesh3d":
            logger.info(f"{step_dir} has no {MANIFEST} (written by Nanotron?): not verified")
        elif unverified_ok:
            logger.warning(f"{step_dir} has lost its {MANIFEST}: loading it unverified "
                           "(mesh3d.load_without_manifest)")  # fmt: skip
        else:
            raise on_every_rank(UserError(
                f"checkpoint {step_dir} was written by mesh3d (checkpoint_metadata.json says "
                f"so) but its {MANIFEST} is missing, so its files cannot be verified. Restore "
                "the file from a copy, resume from another step folder, or set "
                "mesh3d.load_without_manifest=true to load it unverified"
            ))  # fmt: skip
        return
    problems = [p for ps in _everyone(verify(step_dir, *_rank_world())) for p in ps]
    if problems:
        raise on_every_rank(damaged_error(step_dir, problems))


def load_weights(folder: Path, parts, layout: RunLayout, optimizer=None) -> None:
    """Fill this rank's parameters from the weights in `folder` (a step folder or what
    `from-hf` writes), saved at any tp/pp and vocabulary padding; with `optimizer`, its state
    too."""
    saved = json.loads((folder / "model_config.json").read_text())
    shape = layout.shape
    saved_shape = dataclasses.replace(shape, padded_vocab=int(saved["vocab_size"]))
    held = held_parameters(parts.modules)
    if lora_of(folder) is not None:  # a LoRA run's: its adapters (the base is built already)
        params = extensions.load("lora_files").adapter_params(layout.lora, 0, held)
        return load_rank_state(folder, params, held, optimizer, optimizer is not None)
    if parts.params_of is not None:  # a transformers model: its own names, split as saved
        return load_rank_state(folder, parts.params_of(0, folder), held, optimizer, bool(optimizer))
    params = [p for p in nanotron_params(saved_shape) if all(o in held for o in p.ours)]
    load_rank_state(folder, params, held, optimizer, optimizer is not None,
                    rows=shape.padded_vocab)  # fmt: skip


def lora_of(folder: Path) -> dict | None:
    """The `lora` entry of a step folder's metadata (a LoRA run's checkpoint), else None."""
    try:
        meta = json.loads((folder / "checkpoint_metadata.json").read_text())
    except (OSError, ValueError):
        return None
    return (meta.get("custom_metas") or {}).get("lora") if isinstance(meta, dict) else None


def load_checkpoint(path: str | Path, parts, optimizer, scheduler, cfg, *, layout: RunLayout,
                    load_optimizer: bool = True, load_lr_scheduler: bool = True,
                    ) -> tuple[int, int]:  # fmt: skip
    """Load weights (and optimizer/scheduler state) into this rank's parts, at any layout.
    (last_train_step, consumed_train_samples); (0, 0) without `load_lr_scheduler`, as Nanotron."""
    step_dir = resolve_step_dir(path)
    meta = nanotron_state.read_metadata(step_dir)
    verify_everywhere(step_dir, meta, cfg.mesh3d.load_without_manifest)
    custom = meta.get("custom_metas") or {}
    saved_lora = custom.get("lora")
    if saved_lora is not None or layout.lora is not None:  # the same adapters and base
        extensions.load("lora_files").check_lora_match(step_dir, saved_lora, cfg, layout)
    load_weights(step_dir, parts, layout, optimizer if load_optimizer else None)
    par, c = layout.dims, layout.coords
    saved = (meta["tp"], meta["dp"], custom.get("pp"), meta.get("cp", 1))
    same_layout = saved == (par.tp, par.dp, par.pp, par.cp)
    rng = (
        step_dir
        / "random"
        / nanotron_state.random_file(c["tp"], par.tp, c["dp"], par.dp, c["pp"], par.pp)
    )
    if custom.get("writer") == "mesh3d" and same_layout and rng.is_file():  # Nanotron's pickle
        nanotron_state.set_random_states(nanotron_state.safe_load(rng, "random-state"), rng)
    if not load_lr_scheduler:
        return 0, 0
    _load_scheduler(step_dir, scheduler, optimizer, layout)
    metas = meta["metas"]
    return int(metas["last_train_step"]), int(metas["consumed_train_samples"])
