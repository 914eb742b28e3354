"""Where the per-iteration metrics go: one record, every sink, the same values.

The metrics-owning rank (pp = last stage, dp 0, tp 0 — Nanotron's logger rank) builds one dict
per logged iteration and hands it to `MetricSinks.write`, which sends it to
- the console: Nanotron's CLASSIC line (`format_iteration_line`), plus an `eta` item;
- `--metrics-file`: one JSON object per line, one file per run: a fresh run replaces the file, a
  run resumed at step N keeps its records up to N and appends after them (`JsonlWriter`);
- Weights & Biases (`mesh3d.wandb`: null = Nanotron's rule, on when `wandb` imports — here also
  only when it can log without asking: `WANDB_MODE` or `WANDB_API_KEY` set, or a saved login;
  true = on; false = off). Project `general.project`, run name Nanotron's
  `<dd/mm/YYYY_HH:MM:SS>_<general.run>` with `%date` / `%jobid` expanded; the run id is kept in
  the checkpoint so a resumed run continues the same W&B run;
- TensorBoard (`mesh3d.tensorboard_dir`): one scalar per key, step = iteration.
Only the metrics-owning rank opens any sink, so each is written once.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
from pathlib import Path

from mesh3d.config import config_to_dict, expand_run_name
from mesh3d.log import logger
from mesh3d.train.metrics import JsonlWriter, format_iteration_line


def wandb_wanted(setting: bool | None) -> bool:
    """`mesh3d.wandb`: True/False as given; None -> installed and able to log without a prompt."""
    if setting is not None:
        return setting
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    if os.environ.get("WANDB_MODE") == "disabled":
        return False
    netrc = Path.home() / ".netrc"
    logged_in = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    return bool(os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY") or logged_in)


def eta_text(seconds: float) -> str:
    """HEAD's `eta` format: `str(timedelta(seconds=int(s)))`, e.g. `0:01:05`, `1 day, 1:15:30`."""
    return str(datetime.timedelta(seconds=int(seconds)))


class MetricSinks:
    """The sinks of the metrics-owning rank (`active`); on other ranks every call is a no-op.

    `start_step` is the step the run resumes from (0 for a fresh run). The metrics file holds one
    run: a fresh run replaces it; a resumed run keeps the records with `iteration <= start_step`
    and appends after them, so resuming from step 10 a file that reached step 15 gives 1..10, 11...
    """

    def __init__(
        self,
        cfg,
        active: bool,
        metrics_file: str | None,
        wandb_id: str | None = None,
        *,
        start_step: int = 0,
    ):
        self.active, self.train_steps = active, cfg.tokens.train_steps
        console = cfg.mesh3d.console
        self.compact = console == "compact" or (console == "auto" and sys.stdout.isatty())
        self.jsonl = JsonlWriter(metrics_file, start_step) if active and metrics_file else None
        self.tb = self.wandb = None
        self.wandb_id = wandb_id
        if not active:
            return
        if cfg.mesh3d.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=cfg.mesh3d.tensorboard_dir)
        if wandb_wanted(cfg.mesh3d.wandb):
            import wandb

            stamp = datetime.datetime.now().strftime("%d/%m/%Y_%H:%M:%S")
            self.wandb = wandb.init(
                project=cfg.general.project,
                name=f"{stamp}_{expand_run_name(cfg.general.run)}",
                config={"nanotron_config": config_to_dict(cfg)},
                id=wandb_id,
                resume="allow" if wandb_id else None,
            )
            self.wandb_id = self.wandb.id
            logger.info(f"Weights & Biases run {self.wandb.id} ({self.wandb.name})")

    def eta(self, iteration: int, step_seconds: list[float]) -> float:
        """Seconds left: the steps left times the median step of this run (the first, which
        warms up, left out once there are others), steady where a loaded host's steps vary."""
        timed = step_seconds[1:] or step_seconds
        return (self.train_steps - iteration) * (statistics.median(timed) if timed else 0.0)

    def progress(self, record: dict, step_seconds: list[float]) -> None:
        """The compact console line of every step (`mesh3d.console: compact`, or `auto` on a
        terminal): `step 12/200 | loss 5.1234 | lr 3.00e-03 | 2,950 tokens/s | eta 0:01:05`."""
        if not (self.active and self.compact):
            return
        val = f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        logger.info(
            f"step {record['iteration']}/{self.train_steps} | loss {record['lm_loss']:.4f}{val} | "
            f"lr {record['lr']:.2e} | {record.get('tokens_per_sec', 0.0):,.0f} tokens/s | eta "
            f"{eta_text(self.eta(record['iteration'], step_seconds))}"
        )

    def write(self, record: dict, step_seconds: list[float]) -> None:
        """Send one iteration's record everywhere; `step_seconds` (this run's steps) gives the
        ETA. In the compact console form the Nanotron line is left out (`progress` shows it)."""
        if not self.active:
            return
        if not self.compact:
            eta = eta_text(self.eta(record["iteration"], step_seconds))
            logger.info(format_iteration_line(record, self.train_steps) + f" | eta: {eta}")
        if self.jsonl:
            self.jsonl.write(record)
        numbers = {
            k: v for k, v in record.items() if isinstance(v, int | float) and math.isfinite(v)
        }
        if self.tb:
            for key, value in numbers.items():
                if key != "iteration":
                    self.tb.add_scalar(key, value, global_step=record["iteration"])
            self.tb.flush()
        if self.wandb:
            self.wandb.log(
                {**numbers, "iteration_step": record["iteration"]}, step=record["iteration"]
            )

    def scores(self, record: dict) -> None:
        """An in-run evaluation's scores ({"iteration": step, "eval/<task>/<metric>": value}) to
        the metrics file, TensorBoard and W&B (the console line is the evaluation's own)."""
        if not self.active:
            return
        if self.jsonl:
            self.jsonl.write(record)
        numbers = {k: v for k, v in record.items() if k != "iteration"}
        if self.tb:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, global_step=record["iteration"])
            self.tb.flush()
        if self.wandb:
            self.wandb.log(numbers, step=record["iteration"])

    def close(self) -> None:
        """Close every sink; name where TensorBoard and W&B wrote (printed just before the
        run's summary)."""
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
            where = self.tb.get_logdir()
            logger.info(f"TensorBoard scalars written to {where} (tensorboard --logdir {where})")
            self.tb = None
        if self.wandb:
            run = self.wandb
            url = getattr(run, "url", None) or "offline: wandb sync to upload"
            where = getattr(run, "dir", None) or "wandb/"
            logger.info(f"Weights & Biases run {run.id} written to {where} ({url})")
            run.finish()
            self.wandb = None
