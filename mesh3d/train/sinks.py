"""Where the per-iteration metrics go: one record, every sink, the same values. Only the
metrics-owning rank (last pp stage, dp 0, tp 0: Nanotron's logger rank) opens sinks. The W&B
run id is kept in the checkpoint so that a resume continues the run."""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
from pathlib import Path

from mesh3d.config import config_to_dict, expand_run_name
from mesh3d.errors import UserError, unwritable
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
    `start_step`: the step the run resumes from (0: fresh), for the metrics file. `error`: why
    a sink could not open (a `UserError`'s message), for the caller to raise on every rank."""

    def __init__(self, cfg, active: bool, metrics_file: str | None, wandb_id: str | None = None,
                 *, start_step: int = 0):  # fmt: skip
        self.active, self.train_steps = active, cfg.tokens.train_steps
        console = cfg.mesh3d.console
        self.compact = console == "compact" or (console == "auto" and sys.stdout.isatty())
        self.jsonl = self.tb = self.wandb = self.error = None
        self.wandb_id = wandb_id
        if active:
            try:
                self._open(cfg, metrics_file, start_step)
            except UserError as e:  # the caller shares it: every rank stops alike
                for sink in (self.tb, self.jsonl):
                    if sink:
                        sink.close()
                self.error = str(e)

    def _open(self, cfg, metrics_file: str | None, start_step: int) -> None:
        if cfg.mesh3d.tensorboard_dir:  # first: a bad folder leaves the metrics file as it was
            from torch.utils.tensorboard import SummaryWriter

            try:
                self.tb = SummaryWriter(log_dir=cfg.mesh3d.tensorboard_dir)
            except OSError as e:
                raise unwritable("mesh3d.tensorboard_dir", cfg.mesh3d.tensorboard_dir, e) from None
        self.jsonl = JsonlWriter(metrics_file, start_step) if metrics_file else None
        if wandb_wanted(cfg.mesh3d.wandb):
            import wandb

            stamp = datetime.datetime.now().strftime("%d/%m/%Y_%H:%M:%S")
            self.wandb = wandb.init(
                project=cfg.general.project,
                name=f"{stamp}_{expand_run_name(cfg.general.run)}",
                config={"nanotron_config": config_to_dict(cfg)},
                id=self.wandb_id,
                resume="allow" if self.wandb_id else None,
            )
            self.wandb_id = self.wandb.id
            logger.info(f"Weights & Biases run {self.wandb.id} ({self.wandb.name})")

    def eta(self, iteration: int, step_seconds: list[float]) -> float:
        """Seconds left: steps left times the median step (without the first, once possible)."""
        timed = step_seconds[1:] or step_seconds
        return (self.train_steps - iteration) * (statistics.median(timed) if timed else 0.0)

    def progress(self, record: dict, step_seconds: list[float]) -> None:
        """The compact console line of every step (`mesh3d.console: compact`, or on a tty)."""
        if not (self.active and self.compact):
            return
        val = f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        logger.info(
            f"step {record['iteration']}/{self.train_steps} | loss {record['lm_loss']:.4f}{val} | "
            f"lr {record['lr']:.2e} | {record.get('tokens_per_sec', 0.0):,.0f} tokens/s | eta "
            f"{eta_text(self.eta(record['iteration'], step_seconds))}"
        )

    def write(self, record: dict, step_seconds: list[float]) -> None:
        """Send one iteration's record everywhere; `step_seconds` gives the ETA. The compact
        console form leaves the Nanotron line out (`progress` shows it)."""
        if not self.active:
            return
        if not self.compact:
            eta = eta_text(self.eta(record["iteration"], step_seconds))
            logger.info(format_iteration_line(record, self.train_steps) + f" | eta: {eta}")
        numbers = {
            k: v for k, v in record.items() if isinstance(v, int | float) and math.isfinite(v)
        }
        self._send(record, numbers, {**numbers, "iteration_step": record["iteration"]})

    def scores(self, record: dict) -> None:
        """An in-run evaluation's scores ({"iteration": step, "eval/<task>/<metric>": value}) to
        the metrics file, TensorBoard and W&B (the console line is the evaluation's own)."""
        if self.active:
            numbers = {k: v for k, v in record.items() if k != "iteration"}
            self._send(record, numbers, numbers)

    def _send(self, record: dict, numbers: dict, logged: dict) -> None:
        """`record` to the metrics file, `numbers` to TensorBoard, `logged` to W&B."""
        step = record["iteration"]
        if self.jsonl:
            self.jsonl.write(record)
        if self.tb:
            for key, value in numbers.items():
                if key != "iteration":
                    self.tb.add_scalar(key, value, global_step=step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(logged, step=step)

    def close(self) -> None:
        """Close every sink; say where TensorBoard and W&B wrote."""
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
