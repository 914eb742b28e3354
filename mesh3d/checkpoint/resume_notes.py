"""What a resumed run logs about the checkpoint it resumed from: what differs (layout, global
batch, learning-rate schedule), and the changes it refuses: data stages that would not go on
from the sample the checkpoint reached. Loaded only when a run resumes."""

from __future__ import annotations

from pathlib import Path

import yaml

from mesh3d.checkpoint.load import read_metadata
from mesh3d.checkpoint.training import resolve_step_dir
from mesh3d.config.derive import global_batch_size, stage_sequence_length
from mesh3d.data.stages import stage_consumption
from mesh3d.errors import UserError, on_every_rank

_SCHEDULE_KEYS = ("lr_warmup_steps", "lr_decay_steps", "lr_decay_starting_step")


def resume_change(path: str | Path, cfg, layout, start: int, gbs: int | None = None) -> str:
    """What differs between the checkpoint at `path` (at step `start`) and the run `cfg`
    resuming it, for the resume line: its layout (the random states are then not restored),
    its global batch and its learning-rate schedule's steps (from the config.yaml saved with
    it); "" when none. A `UserError` when the data would not go on where it stopped
    (`check_data_position`; `gbs`: the samples a step reads, all fault-tolerant groups' slots)."""
    step_dir, dims = resolve_step_dir(path), layout.dims
    meta = read_metadata(step_dir)
    check_data_position(step_dir, meta, cfg, start, gbs or layout.global_batch)
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


def check_data_position(step_dir: Path, meta: dict, cfg, start: int, gbs: int) -> None:
    """Refuse a run whose data stages would not go on from the samples the checkpoint reached.
    A stage's samples are read by position (its steps x the samples a step reads, at its
    sequence length), so the run must read `gbs` samples a step as the checkpoint's run did
    (its consumed samples / `start`), each stage must have had the steps through `start` the
    metadata's counts say, and a begun stage keeps its length. Streamed data keeps its own
    positions: not checked."""
    metas = meta.get("metas") or {}
    saved, stages = metas.get("data_stages") or [], cfg.data_stages or []
    if not saved or not start or cfg.mesh3d.hf_streaming:
        return
    fresh = f"or start a fresh run from its weights (model.init_method: {{path: {step_dir}}})"
    old_gbs = int(metas.get("consumed_train_samples") or 0) // start
    if old_gbs and old_gbs != gbs:
        per = cfg.parallelism.dp * cfg.tokens.micro_batch_size
        e_g = (
            f": e.g. tokens.batch_accumulation_per_replica={old_gbs // per}"
            if old_gbs % per == 0
            else ""
        )
        raise on_every_rank(UserError(
            f"checkpoint {step_dir} read {old_gbs} samples a step and this run reads {gbs}: its "
            "data stages would go on from another sample (a stage's samples are read by step x "
            "global batch), training some twice or skipping some. Keep the global batch at "
            f"{old_gbs} (dp x micro_batch_size x batch_accumulation_per_replica{e_g}), {fresh}"
        ))  # fmt: skip
    # the stages' own count a step (the metadata's: a fault-tolerant group's counts its slots)
    per_step = sum(int(s.get("consumed_train_samples") or 0) for s in saved) // start
    counts = stage_consumption([s.start_training_step for s in stages], start, per_step)
    for i in range(max(len(saved), len(stages))):
        was = saved[i] if i < len(saved) else {}
        had, has = int(was.get("consumed_train_samples") or 0), counts[i] if i < len(stages) else 0
        name = was.get("name") or stages[i].name
        if had != has:
            raise on_every_rank(UserError(
                f"checkpoint {step_dir} consumed {had} samples of data stage {i} ({name!r}) in its "
                f"{start} steps, and this config would have consumed {has}: the stage would go on "
                "from another sample, training some twice or skipping some. Keep the data stages' "
                f"start_training_step as the checkpoint's run had them, {fresh}"
            ))  # fmt: skip
        length = stage_sequence_length(cfg, stages[i]) if i < len(stages) else None
        if had and was.get("sequence_length") not in (None, length):
            raise on_every_rank(UserError(
                f"checkpoint {step_dir} trained data stage {i} ({name!r}) at sequence_length "
                f"{was['sequence_length']}, and this config says {length}: the stage's samples "
                f"would be cut at other places. Keep {was['sequence_length']}, or train the new "
                f"length in a new data stage from step {start + 1}"
            ))  # fmt: skip
