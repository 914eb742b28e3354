"""Reading a checkpoint back: weights, optimizer, scheduler, random and data state, metadata,
at any layout. Loaded only on resume, init from a checkpoint, generate and convert."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mesh3d import extensions
from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.atomic import _everyone, _rank_world
from mesh3d.checkpoint.folder import MANIFEST, damaged_error, is_hf_folder, verify
from mesh3d.checkpoint.nanotron_state import MASTER
from mesh3d.checkpoint.nanotron_weights import Param, nanotron_params, read_param, unshard
from mesh3d.checkpoint.state import _state_keys, held_parameters
from mesh3d.checkpoint.training import lora_of, resolve_step_dir
from mesh3d.errors import UserError, on_every_rank
from mesh3d.layout import RunLayout
from mesh3d.log import Progress, logger
from mesh3d.nanotron_names import MAX_READ_VERSION
from mesh3d.torch_private import set_scheduler_position

_OPT_RE = re.compile(
    r"optimizer_pp-(\d+)-of-(\d+)(?:_dp-(\d+)-of-(\d+))?_tp-(\d+)-of-(\d+)_exp-(\d+)-of-(\d+)\.pt"
)


def safe_load(path: Path, what: str):
    """`torch.load` of plain tensors and containers only, memory-mapped; clear errors."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise UserError(f"missing {what} file {path}; the checkpoint is incomplete") from None
    except Exception as e:  # weights_only refusals and damaged zip files raise several types
        raise UserError(
            f"cannot read {what} file {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}; "
            "the file is corrupted or holds more than plain tensors"
        ) from None


class OptimizerFiles:
    """Every optimizer file of a step folder, indexed by Nanotron parameter name; `full`
    rebuilds a full tensor from any (pp, dp, tp) layout and ZeRO stage."""

    def __init__(self, folder: Path):
        self.folder = folder
        config_path = folder / "optimizer_config.json"
        if not config_path.is_file():
            raise UserError(
                f"missing {config_path}: the checkpoint has no optimizer state; resume with "
                "checkpoints.load_optimizer: false to load the weights only"
            )
        config = json.loads(config_path.read_text())
        par = config.get("parallelism", {})
        self.tp, self.dp = int(par.get("tp_size", 1)), int(par.get("dp_size", 1))
        cfgs = config.get("configs") or {}
        self.offsets = cfgs.get("param_name_to_dp_rank_offsets")
        self.shapes = cfgs.get("orig_param_shapes", {})
        # name -> {(tp_rank, dp_rank): (payload, index)}
        self.where: dict[str, dict[tuple[int, int], tuple[dict, int]]] = {}
        files = sorted(folder.glob("optimizer_*.pt"))
        if not files:
            raise UserError(f"{folder} has no optimizer_*.pt files; the checkpoint is incomplete")
        for path in files:
            m = _OPT_RE.fullmatch(path.name)
            if not m:
                continue
            tp_rank, dp_rank = int(m.group(5)), int(m.group(3) or 0)
            payload = safe_load(path, "optimizer")
            for idx, name in payload.get("names", {}).items():
                self.where.setdefault(name, {})[(tp_rank, dp_rank)] = (payload, int(idx))
        self.has_master = any(
            "gradient_accumulator" in pl for d in self.where.values() for pl, _ in d.values()
        )

    def _local(self, p: Param, key: str, tp_rank: int) -> Tensor | None:
        """TP rank `tp_rank`'s tensor of state `key` (ZeRO-1 slices joined and reshaped)."""
        found = self.where.get(p.name)
        if not found:
            raise UserError(
                f"{self.folder} has no optimizer state for {p.name}; the checkpoint is "
                "incomplete or of another model"
            )
        slices = []
        for (t, d), (payload, idx) in sorted(found.items(), key=lambda kv: kv[0][1]):
            if t != tp_rank:
                continue
            if key == MASTER:
                value = payload.get("gradient_accumulator", {}).get(p.name)
            else:
                value = payload["state"].get(idx, {}).get(key)
            if value is None:
                return None
            slices.append((d, value))
        if not slices:
            raise UserError(f"{self.folder}: no optimizer file of tp rank {tp_rank} has {p.name}")
        if self.offsets is None:  # ZeRO-0: one file per (pp, tp)
            return slices[0][1]
        shape = tuple(int(x) for x in self.shapes[p.name])
        flat = torch.cat([v.reshape(-1) for _, v in slices])
        if flat.numel() != math.prod(shape):
            raise UserError(
                f"{self.folder}: ZeRO-1 slices of {p.name} hold {flat.numel()} elements, "
                f"expected {math.prod(shape)} (shape {shape}); a dp rank's file is missing"
            )
        return flat.view(shape)

    def full(self, p: Param, key: str) -> Tensor | None:
        """Full tensor of state `key` of `p`, or None when the files have no such state."""
        tp = 1 if p.kind == "replicated" else self.tp
        shards = {}
        for t in range(tp):
            local = self._local(p, key, t)
            if local is None:
                return None
            shards[t] = local
        return unshard(p, shards, tp)

    def step(self, p: Param) -> Tensor | None:
        """AdamW's step counter of `p` (the same on every shard)."""
        payload, idx = next(iter(self.where.get(p.name, {}).values()), (None, None))
        return None if payload is None else payload["state"].get(idx, {}).get("step")


def read_metadata(step_dir: Path) -> dict:
    """The step's `checkpoint_metadata.json`, version- and field-checked: a `UserError` names
    any field mesh3d reads that has the wrong type or range."""
    path = step_dir / "checkpoint_metadata.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"missing {path}; not a complete checkpoint step folder") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}); restore it from a copy") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("metas"), dict):
        raise UserError(f"{path} has no `metas` object; not a checkpoint_metadata.json")
    try:
        version = tuple(int(x) for x in str(meta["version"]).split("."))
    except (KeyError, ValueError):
        raise UserError(
            f"{path}: `version` is missing or not like 1.4 (got {meta.get('version')!r})"
        ) from None
    if version > MAX_READ_VERSION:
        raise UserError(
            f"{path} is checkpoint version {meta['version']}, newer than the "
            f"{'.'.join(map(str, MAX_READ_VERSION))} mesh3d reads"
        )
    metas, custom = meta["metas"], meta.get("custom_metas")
    fields = [(meta, "", "tp", 1), (meta, "", "dp", 1), (metas, "metas.", "last_train_step", 0),
              (metas, "metas.", "consumed_train_samples", 0)]  # fmt: skip
    if isinstance(custom, dict) and "pp" in custom:
        fields.append((custom, "custom_metas.", "pp", 1))
    for where, prefix, key, low in fields:
        value = where.get(key)
        if type(value) is not int or value < low:
            shown = "missing" if key not in where else f"{value!r}"
            raise UserError(
                f"{path}: `{prefix}{key}` must be an integer >= {low}, got {shown}; the file was "
                "edited or damaged: restore it or fix that field"
            )
    return meta


def set_random_states(states: dict, path: Path | None = None) -> None:
    """Restore what `random_states` saved (from `path`, named in the error if it is damaged)."""
    try:
        torch.set_rng_state(states["torch_cpu"])
        if "torch_cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["torch_cuda"])
        py = states["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), None))
        n = states["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError, AttributeError) as e:
        raise UserError(
            f"random-state file {path} is damaged ({type(e).__name__}: {e}); delete it to "
            "resume with fresh random states (the data order does not depend on them)"
        ) from None


def _fit_rows(t: torch.Tensor, p: Param, rows: int | None) -> torch.Tensor:
    """Vocabulary tensors re-padded to `rows` (padding rows are zero and never trained)."""
    if rows is None or p.kind != "vocab" or t.shape[0] == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    n = min(rows, t.shape[0])
    out[:n] = t[:n]
    return out


def _place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, laid out like `like` (a DTensor, an expert slice, a tensor)."""
    shard = getattr(like, "expert_shard", None)
    if shard is not None:
        full = extensions.load("expert_parallel").slice_expert_shard(full, shard)
    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.clone()


def _assign(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` into `param` in place."""
    local = _place(full, param)
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(local)


def load_rank_state(step_dir: Path, params: list[Param], held: dict[str, list[nn.Parameter]],
                    optimizer: torch.optim.Optimizer | None, load_optimizer: bool,
                    rows: int | None = None) -> None:  # fmt: skip
    """Fill this rank's parameters (and optimizer state) from `step_dir`, saved at any layout.
    `params` describe the tensors as saved; `rows` re-pads vocabulary tensors."""
    files = OptimizerFiles(step_dir / "optimizer") if load_optimizer else None
    progress = Progress(f"Loading checkpoint {step_dir}", len(params))
    for p in params:
        master = files.full(p, MASTER) if files is not None and files.has_master else None
        weights = master if master is not None else read_param(step_dir / "model", p)
        states, step = {}, None
        keys = _state_keys(optimizer, held[p.ours[0]][0]) if files is not None else ()
        if keys:
            states = {k: v for k in keys if (v := files.full(p, k)) is not None}
            step = files.step(p)
        for i, o in enumerate(p.ours):
            ours = {k: _fit_rows(torch.split(v, p.chunks)[i], p, rows)
                    for k, v in {"weight": weights, **states}.items()}  # fmt: skip
            for q in held[o]:
                _assign(q, ours["weight"])
                if states:
                    optimizer.state[q] = {k: _place(ours[k], q) for k in states}
                    if "exp_avg" in states:  # AdamW's step counter
                        optimizer.state[q]["step"] = (
                            torch.zeros(()) if step is None else step.float().clone()
                        )
        progress.update()
    progress.done()


def not_a_folder(path: Path) -> str:
    """Why `path`, which is no folder, cannot be read as one: for a message "KEY PATH <this>"."""
    return "is a file, not a folder" if path.exists() else "does not exist"


def weights_dir(path: str | Path, key: str) -> Path:
    """A folder of weights to read (not resume): one with `model_config.json` (a step folder,
    or what `from-hf` writes), else the step folder `resolve_step_dir` finds."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{key} {path} {not_a_folder(path)}; give a step folder or a checkpoints "
                        "folder")  # fmt: skip
    return path if (path / "model_config.json").is_file() else resolve_step_dir(path, key)


def verified(step: Path) -> Path:
    """`step`, once its files match its manifest (one without a manifest is taken as it is):
    what reads a checkpoint's weights without loading it for training (convert, generate)."""
    if problems := verify(step):
        raise damaged_error(step, problems)
    return step


def load_data_state(path: str | Path) -> list[dict]:
    """The streamed-data positions a checkpoint saved, one per dp rank it was saved with."""
    files = sorted((resolve_step_dir(path) / "data").glob("stream_dp-*.pt"))
    return [safe_load(f, "streamed-data position") for f in files]


def checkpoint_custom_metas(path: str | Path) -> dict | None:
    """The `custom_metas` of the step folder `path` resolves to (None for Nanotron's)."""
    return read_metadata(resolve_step_dir(path)).get("custom_metas")


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
    k = int(safe_load(files[0], "LR scheduler")["last_epoch"])
    scheduler.last_epoch = k
    lrs = [base * f(k) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    set_scheduler_position(scheduler, k + 1, lrs)


def verify_everywhere(step_dir: Path, meta: dict, unverified_ok: bool = False,
                      skip: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Check the manifest's checksums (but of the folders `skip` names: not loaded), the files
    spread over the ranks; every rank raises the same `UserError`. Without a manifest: passes
    when Nanotron wrote the folder, else refused unless `unverified_ok`."""
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
    problems = [p for ps in _everyone(verify(step_dir, *_rank_world(), skip)) for p in ps]
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


def load_checkpoint(path: str | Path, parts, optimizer, scheduler, cfg, *, layout: RunLayout,
                    load_optimizer: bool = True, load_lr_scheduler: bool = True,
                    ) -> tuple[int, int]:  # fmt: skip
    """Load weights (and optimizer/scheduler state) into this rank's parts, at any layout.
    (last_train_step, consumed_train_samples); (0, 0) without `load_lr_scheduler`, as Nanotron."""
    step_dir = resolve_step_dir(path)
    meta = read_metadata(step_dir)
    unread = ("optimizer/",) * (not load_optimizer) + ("lr_scheduler/",) * (not load_lr_scheduler)
    verify_everywhere(step_dir, meta, cfg.mesh3d.load_without_manifest, unread)
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
        set_random_states(safe_load(rng, "random-state"), rng)
    if not load_lr_scheduler:
        return 0, 0
    _load_scheduler(step_dir, scheduler, optimizer, layout)
    metas = meta["metas"]
    return int(metas["last_train_step"]), int(metas["consumed_train_samples"])


def not_a_checkpoint(path: Path) -> UserError | None:
    """The error for an `init_method.path` that is neither a Hugging Face model folder nor a
    step folder (with `model/`); None when it is one."""
    if (path / "model").is_dir() or is_hf_folder(path):
        return None
    if not path.is_dir():
        has = not_a_folder(path)
    elif any(path.glob("*.safetensors")):
        has = "has *.safetensors but no config.json"
    else:
        has = "has neither config.json (a Hugging Face model) nor model/ (a checkpoint)"
    return UserError(
        f"`model.init_method.path` {path} {has}: give a Hugging Face model folder (config.json "
        "and *.safetensors, as `huggingface-cli download` writes it) or a Nanotron/mesh3d step "
        "folder (with model/)"
    )
