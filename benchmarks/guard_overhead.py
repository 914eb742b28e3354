"""What the fail-safe guard costs per training step: guarded steps against bare ones, interleaved.

    python benchmarks/guard_overhead.py              # dp 2 on 2 forked ranks, 60 rounds
    python benchmarks/guard_overhead.py --rounds 20  # quicker

Each rank builds the run `mesh3d.train` builds (`_setup`, `recipes/configs/cpu_tiny.yaml`) and
enters its `RunGuard` (heartbeat every second: collective timeout 5 s, 10x the default rate).
Round k runs two training steps, in an order that alternates every round:
- bare: `_run_step`, then `dist.barrier()` (how steps ended before the guard);
- guarded: `RunGuard.at` (wakes the heartbeat thread, which publishes the step), `_run_step`,
  `stop_requested()` (the one-integer all-reduce that replaced the barrier) and
  `check_finite`, as the training loop does.
The heartbeat thread runs during both. Reported: median step time of each, the ratio of the
medians and the median of the per-round ratios with a bootstrap 95% interval. Results go to
`benchmarks/results/local/guard_overhead.json` (`--publish`: `benchmarks/results/`).
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
from mesh3d.train.guard import RunGuard  # noqa: E402
from mesh3d.train.loop import _run_step, _setup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rank_main(rank: int, world: int, rounds: int) -> dict:
    overrides = [f"parallelism.dp={world}", "mesh3d.device=cpu", "logging.log_level=warning",
                 "mesh3d.collective_timeout_s=5", f"tokens.train_steps={2 * rounds + 2}"]  # fmt: skip
    cfg = load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", overrides)
    run = _setup(cfg)
    times: dict[str, list[float]] = {"bare": [], "guarded": []}
    with RunGuard(cfg, run.device) as guard:
        step = 0

        def bare() -> None:
            _run_step(run, step)
            dist.barrier()

        def guarded() -> None:
            guard.at(step, "step")
            _, loss, grad_norm = _run_step(run, step)
            guard.stop_requested()
            guard.check_finite(step, loss, grad_norm)

        for k in range(rounds):
            order = (("bare", bare), ("guarded", guarded))
            for name, fn in order if k % 2 == 0 else order[::-1]:
                step += 1
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2, help="first rounds left out (warm-up)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")
    times = launch(args.world, rank_main, args.rounds, timeout=1800)[0]
    bare, guarded = (times[k][args.skip :] for k in ("bare", "guarded"))
    ratios = [g / b for g, b in zip(guarded, bare)]
    low, high = bootstrap_median(ratios)
    result = {
        "date": str(datetime.date.today()),
        "torch": torch.__version__,
        "world": args.world,
        "rounds": len(bare),
        "bare_median_ms": 1e3 * statistics.median(bare),
        "guarded_median_ms": 1e3 * statistics.median(guarded),
        "ratio_of_medians": statistics.median(guarded) / statistics.median(bare),
        "per_round_ratio_median": statistics.median(ratios),
        "per_round_ratio_ci95": [low, high],
    }
    print(f"dp {args.world}, {len(bare)} rounds (first {args.skip} left out), cpu_tiny.yaml")
    print(f"bare step    median {result['bare_median_ms']:.1f} ms")
    print(f"guarded step median {result['guarded_median_ms']:.1f} ms")
    print(
        f"guarded / bare: ratio of medians {result['ratio_of_medians']:.3f}; per-round median "
        f"{result['per_round_ratio_median']:.3f} [95% CI {low:.3f}, {high:.3f}]"
    )
    out = results_dir(args.publish) / "guard_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
