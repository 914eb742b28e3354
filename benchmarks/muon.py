"""Muon against AdamW: the optimizer step's time, at one process and at dp2 x tp2 x pp2, and
the loss each reaches at its best learning rate.

    python benchmarks/muon.py            # ~8 min on 2 cores
    python benchmarks/muon.py --quick

1. Step time: the default config's model (the built-in corpus of `mesh3d train`, 16 sequences
   of 128 tokens a step) trained 12 steps with each optimizer, at one process and at
   dp2 x tp2 x pp2 with ZeRO-1 (8 ranks on this machine's cores); the time inside
   `optimizer.step()` (rank 0, steps 3-12, median) and the whole step's.
2. Loss: `--steps` steps at each of `--rates` learning rates per optimizer (one process, the
   same data and initialization); the mean training loss of the last 10 steps, and each
   optimizer's best rate and loss (a run that diverges counts as not trained).
Results: benchmarks/results/local/muon[_quick].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from _ranks import launch
from _results import add_publish_flag, print_header, results_dir

from mesh3d.config import load_config
from mesh3d.data.corpus import default_run_overrides

DEFAULT = Path(__file__).resolve().parents[1] / "mesh3d" / "configs" / "default.yaml"
ADAMW = ("optimizer.optimizer_factory={name: adamW, adam_eps: 1.0e-8, adam_beta1: 0.9, "
         "adam_beta2: 0.95, torch_adam_is_fused: false}")  # fmt: skip
MUON = "optimizer.optimizer_factory={name: muon}"


def _config(optimizer: str, lr: float, steps: int, extra=()):
    return load_config(DEFAULT, [
        *default_run_overrides(), optimizer, f"tokens.train_steps={steps}", "checkpoints=null",
        f"optimizer.learning_rate_scheduler.learning_rate={lr}",
        f"optimizer.learning_rate_scheduler.min_decay_lr={lr / 10}",
        f"optimizer.learning_rate_scheduler.lr_warmup_steps={max(1, steps // 10)}",
        "logging.log_level=warning", "tokens.val_check_interval=-1", "tokens.limit_val_batches=0",
        "general.run=muon-bench", *extra,
    ])  # fmt: skip


def _timed_rank(rank: int, world: int, optimizer: str, lr: float, extra: list[str]) -> dict:
    """Train 12 steps; the seconds spent in optimizer.step() per step and whole steps (ms)."""
    from mesh3d.train import muon
    from mesh3d.train.loop import train

    spent: list[float] = []
    for cls in (torch.optim.AdamW, muon.MuonAdamW):
        step = cls.step

        def timed(self, *a, _step=step, **k):
            t0 = time.perf_counter()
            out = _step(self, *a, **k)
            spent.append(time.perf_counter() - t0)
            return out

        cls.step = timed
    res = train(_config(optimizer, lr, 12, extra))
    return {"opt_ms": [s * 1000 for s in spent[2:]],
            "step_ms": [m["elapsed_time_per_iteration_ms"] for m in res.metrics[2:]]}  # fmt: skip


def _loss_rank(rank: int, world: int, optimizer: str, lr: float, steps: int) -> float:
    from mesh3d.errors import RunStopped
    from mesh3d.train.loop import train

    try:
        losses = [m["lm_loss"] for m in train(_config(optimizer, lr, steps)).metrics]
    except RunStopped:
        return math.inf
    tail = losses[-10:]
    return statistics.mean(tail) if all(math.isfinite(x) for x in tail) else math.inf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=60)
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    steps = 20 if args.quick else args.steps
    head = print_header()
    three_d = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "optimizer.zero_stage=1",
               "tokens.batch_accumulation_per_replica=2", "tokens.micro_batch_size=4"]  # fmt: skip
    timing = {}
    for name, opt, lr in (("adamw", ADAMW, 3e-3), ("muon", MUON, 2e-2)):
        for layout, world, extra in (("1 process", 1, []), ("2x2x2", 8, three_d)):
            got = launch(world, _timed_rank, opt, lr, extra, timeout=1800)[0]
            timing[f"{name} {layout}"] = {"opt_ms": statistics.median(got["opt_ms"]),
                                          "step_ms": statistics.median(got["step_ms"])}  # fmt: skip
    print("optimizer.step() and whole step, median ms (rank 0, steps 3-12):")
    for key, t in timing.items():
        print(f"  {key:18s} optimizer {t['opt_ms']:8.1f}   step {t['step_ms']:8.1f}")
    for layout in ("1 process", "2x2x2"):
        r = timing[f"muon {layout}"]["opt_ms"] / timing[f"adamw {layout}"]["opt_ms"]
        print(f"  Muon / AdamW optimizer step at {layout}: {r:.2f}x")
    rates = {"adamw": [1e-3, 3e-3, 1e-2], "muon": [5e-3, 1e-2, 2e-2, 5e-2]}
    if args.quick:
        rates = {"adamw": [3e-3], "muon": [2e-2]}
    losses: dict = {}
    for name, opt in (("adamw", ADAMW), ("muon", MUON)):
        for lr in rates[name]:
            losses[f"{name} {lr:g}"] = launch(1, _loss_rank, opt, lr, steps, timeout=1800)[0]
    print(f"mean loss of the last 10 of {steps} steps, one process:")
    best = {}
    for name in ("adamw", "muon"):
        row = {lr: losses[f"{name} {lr:g}"] for lr in rates[name]}
        print(f"  {name:6s} " + "  ".join(f"lr {lr:g}: {v:.4f}" for lr, v in row.items()))
        lr = min(row, key=row.get)
        best[name] = {"lr": lr, "loss": row[lr]}
        print(f"         best: lr {lr:g}, loss {row[lr]:.4f}")
    result = {**head, "timing": timing, "steps": steps, "losses": losses,
              "best": best}  # fmt: skip
    out = results_dir(args.publish) / f"muon{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
