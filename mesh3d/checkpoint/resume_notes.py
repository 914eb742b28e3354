"""What a resumed run logs about the checkpoint it resumed from: what differs (layout, global
batch, learning-rate schedule). Loaded only when a run resumes."""

from __future__ import annotations

from pathlib import Path

import yaml

from mesh3d.checkpoint.load import read_metadata
from mesh3d.checkpoint.training import resolve_step_dir
from mesh3d.config.derive import global_batch_size

_SCHEDULE_KEYS = ("lr_warmup_steps", "lr_decay_steps", "lr_decay_starting_step")


def resume_change(path: str | Path, cfg, dims) -> str:
    """What differs between the checkpoint at `path` and the run `cfg` resuming it, for the
    resume line: its layout (the random states are then not restored), its global batch and
    its learning-rate schedule's steps (from the config.yaml saved with it); "" when none."""
    step_dir = resolve_step_dir(path)
    meta = read_metadata(step_dir)
    saved = {"dp": meta["dp"], "tp": meta["tp"], "pp": (meta.get("custom_metas") or {}).get("pp"),
             "cp": meta.get("cp", 1)}  # fmt: skip
    now = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp}
    notes = []
    if saved != now:
        was, is_ = (" ".join(f"{k}{v}" for k, v in d.items()) for d in (saved, now))
        notes.append(f"saved at {was}, now {is_}: the weights and optimizer are resharded, the "
                     "random states start fresh (restored at the same layout only)")  # fmt: skip
    try:
        old = yaml.safe_load((step_dir / "config.yaml").read_text())
        tokens, schedule = old["tokens"], old["optimizer"]["learning_rate_scheduler"]
        batch = meta["dp"] * tokens["micro_batch_size"] * tokens["batch_accumulation_per_replica"]
        steps = {k: schedule[k] for k in _SCHEDULE_KEYS}
    except (OSError, yaml.YAMLError, KeyError, TypeError):  # written by another tool: unknown
        return "; ".join(notes)
    if batch != (now_batch := global_batch_size(cfg)):
        notes.append(f"its global batch was {batch} samples a step, now {now_batch}")
    current = cfg.optimizer.learning_rate_scheduler
    if moved := {k: v for k, v in steps.items() if v != getattr(current, k)}:
        changed = ", ".join(f"{k} {v} -> {getattr(current, k)}" for k, v in moved.items())
        keep = " ".join(f"optimizer.learning_rate_scheduler.{k}={v}" for k, v in moved.items())
        notes.append(f"its learning-rate schedule had {changed} (lr_decay_steps follows "
                     "tokens.train_steps unless set), so the learning rate moves from where it "
                     f"was; keep the old schedule with {keep}")  # fmt: skip
    return "; ".join(notes)
