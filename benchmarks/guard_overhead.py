"""What the fail-safe guard costs per training step: guarded steps against bare ones, interleaved.

    python benchmarks/guard_overhead.py              # dp 2 on 2 forked ranks, 60 rounds
    python benchmarks/guard_overhead.py --rounds 20  # quicker

Each rank builds the run `mesh3d.train` builds (`Run.prepare`, `recipes/configs/cpu_tiny.yaml`, with
`mesh3d.loss_spike: {}`: the loss-spike guard at its defaults) and enters its `RunGuard`
(heartbeat every second: collective timeout 5 s, 10x the default rate). Round k runs three
training steps, in an order that rotates every round:
- bare: `run.step`, then `dist.barrier()` (how steps ended before the guard);
- guarded: `RunGuard.at` (wakes the heartbeat thread, which publishes the step), `run.step`,
  `stop_requested()` (the one-integer all-reduce that replaced the barrier) and
  `check_finite`, as the training loop does without the loss-spike guard;
- spike: the same, plus the loss-spike guard: `train_step` asks its verdict before the
  optimizer step (two running medians of up to 100 values) and `after_step` acts on it.
The heartbeat thread runs during all three. Reported: median step time of each, the ratio of
the medians to bare, and the median of the per-round ratios with a bootstrap 95% interval.
Results go to `benchmarks/results/local/guard_overhead.json` (`--publish`:
`benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import launch  # noqa: E402
from _results import add_publish_flag, results_dir  # noqa: E402
from throughput import bootstrap_median  # noqa: E402

from mesh3d.config import load_config  # noqa: E402
from mesh3d.config.schema import LossSpikeArgs  # noqa: E402
from mesh3d.train.guard import RunGuard  # noqa: E402
from mesh3d.train.run import Run  # noqa: E402
from mesh3d.train.spike import SpikeGuard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


VARIANTS = ("bare", "guarded", "spike")


def rank_main(rank: int, world: int, rounds: int) -> dict:
    overrides = [f"parallelism.dp={world}", "mesh3d.device=cpu", "logging.log_level=warning",
                 "mesh3d.collective_timeout_s=5", f"tokens.train_steps={3 * rounds + 2}",
                 "mesh3d.loss_spike={}"]  # fmt: skip
    cfg = load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", overrides)
    run = Run.prepare(cfg)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with RunGuard(cfg, run.device) as guard:
        step = 0

        def bare() -> None:
            run.step(step)
            dist.barrier()

        def guarded() -> None:
            guard.at(step, "step")
            out = run.step(step)
            loss, grad_norm = out.loss, out.grad_norm
            guard.stop_requested()
            guard.check_finite(step, loss, grad_norm)

        def spike() -> None:
            guard.at(step, "step")
            out = run.step(step, guard.accepts)
            loss, grad_norm = out.loss, out.grad_norm
            guard.stop_requested()
            guard.after_step(step, loss, grad_norm, lambda step_dir: None)

        order = list(zip(VARIANTS, (bare, guarded, spike)))
        for k in range(rounds):
            for name, fn in order[k % 3 :] + order[: k % 3]:
                step += 1
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def spike_guard_cost_us(steps: int = 20_000) -> float:
    """Microseconds of the loss-spike guard's own work per step, its window full (100 steps):
    the question before the update and the count after it."""
    spikes = SpikeGuard(LossSpikeArgs())
    values = [(3.0 + 0.01 * (i % 7), 1.0 + 0.01 * (i % 5)) for i in range(steps)]
    for loss, norm in values[:100]:
        spikes.check(0, loss, norm, str)
    t0 = time.perf_counter()
    for loss, norm in values:
        spikes.check(0, loss, norm, str, spikes.reason(loss, norm))  # the step's one verdict
    return 1e6 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2, help="first rounds left out (warm-up)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")
    times = launch(args.world, rank_main, args.rounds, timeout=1800)[0]
    kept = {name: times[name][args.skip :] for name in VARIANTS}
    medians = {name: statistics.median(kept[name]) for name in VARIANTS}
    result = {"date": str(datetime.date.today()), "torch": torch.__version__,
              "world": args.world, "rounds": len(kept["bare"])}  # fmt: skip
    print(
        f"dp {args.world}, {len(kept['bare'])} rounds (first {args.skip} left out), cpu_tiny.yaml"
    )
    for name in VARIANTS:
        result[f"{name}_median_ms"] = 1e3 * medians[name]
        print(f"{name:8} step median {1e3 * medians[name]:.1f} ms")
    for name, over in (("guarded", "bare"), ("spike", "bare"), ("spike", "guarded")):
        ratios = [a / b for a, b in zip(kept[name], kept[over])]
        low, high = bootstrap_median(ratios)
        key = f"{name}_over_{over}"
        result[key] = {"ratio_of_medians": medians[name] / medians[over],
                       "per_round_ratio_median": statistics.median(ratios),
                       "per_round_ratio_ci95": [low, high]}  # fmt: skip
        print(
            f"{name} / {over}: ratio of medians {medians[name] / medians[over]:.3f}; per-round "
            f"median {statistics.median(ratios):.3f} [95% CI {low:.3f}, {high:.3f}]"
        )
    result["spike_guard_us_per_step"] = spike_guard_cost_us()
    print(f"the loss-spike guard's own work: {result['spike_guard_us_per_step']:.1f} us per step")
    out = results_dir(args.publish) / "guard_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
