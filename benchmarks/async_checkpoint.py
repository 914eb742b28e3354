"""The training time a checkpoint save costs, synchronous vs asynchronous (`mesh3d.async_checkpoint`).

    python benchmarks/async_checkpoint.py             # ~30M parameters, 3 rounds, ~2 min
    python benchmarks/async_checkpoint.py --rounds 5 --publish

One process trains `recipes/configs/cpu_tiny.yaml` with a larger model (the `Run` that
`mesh3d train` builds). Each round measures, side by side on the same run: the median of 5
plain steps (a normal step), then one synchronous save followed by one step, then one
asynchronous save followed by steps until the background write is committed (`checkpoints.poll()` at
each step boundary, as the training loop does). The time lost to a save is the time from the
save's start to the end of the step in which it is committed, minus that many normal steps.
Also reported: the bytes the asynchronous save copies aside (its extra peak memory) against
the model's fp32 parameter bytes, and the CPU seconds of the writer thread (on a CPU-bound
step they are what the asynchronous save still takes from training). Results go to `benchmarks/results/local/async_checkpoint.json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import (  # benchmarks/ is on sys.path when a script runs
    add_publish_flag,
    print_header,
    results_dir,
)

from mesh3d.config import load_config
from mesh3d.train.run import Run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1376",
         "model.model_config.num_attention_heads=8", "model.model_config.num_key_value_heads=4",
         "model.model_config.num_hidden_layers=8", "model.model_config.vocab_size=8000",
         "model.model_config.tie_word_embeddings=false", "model.dtype=float32",
         "mesh3d.device=cpu", "logging.log_level=warning", "tokens.train_steps=100000",
         "checkpoints.checkpoint_interval=100000", "tokens.sequence_length=64",
         "tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=1"]  # fmt: skip


def _steps(run: Run, first: int, n: int) -> list[float]:
    out = []
    for step in range(first, first + n):
        t0 = time.perf_counter()
        run.step(step)
        out.append(time.perf_counter() - t0)
    return out


def one_round(run: Run, step: int) -> tuple[dict, int]:
    """(the round's measurements, the next step)."""
    normal = statistics.median(_steps(run, step, 5))
    step += 5
    t0 = time.perf_counter()
    run.save(step - 1, 0, latest=False)
    save_s = time.perf_counter() - t0
    run.step(step)
    step += 1
    sync_lost = time.perf_counter() - t0 - normal
    t0 = time.perf_counter()
    run.save(step - 1, 0, latest=False, background=True)
    copy_s = time.perf_counter() - t0
    pending = run.checkpoints.pending
    copied, job = pending.nbytes, pending.job
    steps = 0
    while run.checkpoints.pending is not None:
        run.step(step)
        step, steps = step + 1, steps + 1
        run.checkpoints.poll()
    async_lost = time.perf_counter() - t0 - steps * normal
    r = dict(normal_step_s=normal, sync_save_s=save_s, sync_lost_s=sync_lost, async_copy_s=copy_s,
             async_steps_in_flight=steps, async_lost_s=async_lost, async_copied_bytes=copied,
             async_writer_cpu_s=job.cpu_s)  # fmt: skip
    return r, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (sync save, async save)")
    add_publish_flag(ap)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    head = print_header()
    work = Path(tempfile.mkdtemp(prefix="mesh3d-async-ckpt-"))
    overrides = MODEL + [f"checkpoints.checkpoints_path={work}"] + args.overrides
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    run = Run.prepare(load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", overrides))
    n_params = sum(p.numel() for p in run.parts.parameters())
    print(f"parameters: {n_params / 1e6:.1f}M; checkpoints in {work}")
    step = 1 + len(_steps(run, 1, 3))  # warm-up
    rounds = []
    for i in range(args.rounds):
        r, step = one_round(run, step)
        rounds.append(r)
        print(f"round {i + 1}: normal step {r['normal_step_s']:.3f} s | sync: save "
              f"{r['sync_save_s']:.2f} s, lost {r['sync_lost_s']:.2f} s | async: copy "
              f"{r['async_copy_s']:.2f} s, {r['async_steps_in_flight']} steps in flight, lost "
              f"{r['async_lost_s']:.2f} s (writer thread {r['async_writer_cpu_s']:.2f} CPU s)")  # fmt: skip
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = [r["async_lost_s"] / r["sync_lost_s"] for r in rounds]
    result = dict(
        **head, parameters=n_params, rounds=rounds, median=med,
        async_over_sync_lost=statistics.median(ratio), per_round_ratio=ratio,
        copied_over_fp32_params=med["async_copied_bytes"] / (4 * n_params),
    )  # fmt: skip
    print(f"time lost per save, median of {args.rounds}: sync {med['sync_lost_s']:.2f} s, async "
          f"{med['async_lost_s']:.2f} s; async / sync {result['async_over_sync_lost']:.3f} "
          f"(per round {', '.join(f'{x:.3f}' for x in ratio)})")  # fmt: skip
    print(f"async extra memory: {med['async_copied_bytes'] / 2**20:.0f} MiB copied = "
          f"{result['copied_over_fp32_params']:.2f} x the fp32 parameters")  # fmt: skip
    out = results_dir(args.publish) / "async_checkpoint.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
