"""zero_stage 0's gradient sum: one flat all-reduce after the backward vs buckets overlapped with it.

    python benchmarks/overlap.py              # dp2 and dp2 x tp2, 6 rounds, ~3 min
    python benchmarks/overlap.py --rounds 10 --publish

Each layout is one launch of forked gloo ranks (one thread each) training a 31M-parameter Llama
(`recipes/configs/cpu_tiny.yaml` with hidden 512, 8 layers, vocabulary 8000; fp32; 2
microbatches of 2 x 64 tokens per dp rank) at `zero_stage: 0`. Every round runs one step of
each variant, in a rotating order: `flat` (the previous implementation:
`parallel/data.py::allreduce_gradients`, one flat copy of every gradient, all-reduced after the
last backward) and the buckets of `parallel/buckets.py` at `ddp_bucket_cap_mb` 1, 25 and 100.
Per step it records the step time and the exposed communication: the time from the end of the
backward to the optimizer step (what the gradient sum adds after the backward; the tied and
partial-gradient sums and the norm are in it for every variant alike). Memory: the extra bytes
each variant allocates for the sum (the flat copy: every gradient; buckets: `in_flight` x the
largest bucket), from the implementation's own sizes. Medians over rounds, rank 0's clock
(every rank waits for the same collectives). Results go to
`benchmarks/results/local/overlap.json` (`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from _ranks import launch
from _results import add_publish_flag, print_header, results_dir

import mesh3d.train.step as step_module
from mesh3d.config import load_config
from mesh3d.mesh import groups_of
from mesh3d.parallel.buckets import GradBuckets
from mesh3d.train.run import Run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1376",
         "model.model_config.num_attention_heads=8", "model.model_config.num_key_value_heads=4",
         "model.model_config.num_hidden_layers=8", "model.model_config.vocab_size=8000",
         "model.model_config.tie_word_embeddings=false", "model.dtype=float32",
         "optimizer.zero_stage=0", "tokens.sequence_length=64", "tokens.micro_batch_size=2",
         "tokens.batch_accumulation_per_replica=2", "tokens.train_steps=100000",
         "mesh3d.device=cpu", "logging.log_level=warning", "checkpoints=null"]  # fmt: skip
CAPS = (1, 25, 100)


def rank_main(rank: int, world: int, tp: int, rounds: int, device: str = "cpu") -> dict:
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")  # our timing wrapper
    overrides = MODEL + [f"parallelism.dp={world // tp}", f"parallelism.tp={tp}",
                         f"mesh3d.device={device}"]  # fmt: skip
    run = Run.prepare(load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", overrides))
    group = groups_of(run.mesh).replicas
    marks: dict[str, float] = {}
    backward = step_module.forward_backward

    def sync() -> None:  # CUDA runs ahead of the host: the marks wait for the device
        if device == "cuda":
            torch.cuda.synchronize()

    def timed_backward(*a, **k):
        out = backward(*a, **k)
        sync()
        marks["backward_end"] = time.perf_counter()
        return out

    step_module.forward_backward = timed_backward
    update = run.optimizer.step

    def timed_update(*a, **k):
        sync()
        marks["update_start"] = time.perf_counter()
        return update(*a, **k)

    run.optimizer.step = timed_update
    reducers = {cap: [GradBuckets(list(m.parameters()), group, cap * 2**20)
                      for m in run.parts.modules] for cap in CAPS}  # fmt: skip
    for r in run.parts.reducers:
        r.remove()
    variants = {"flat": [], **{f"buckets {cap} MB": reducers[cap] for cap in CAPS}}
    grads = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in run.parts.parameters()) * 4  # fmt: skip
    extra = {"flat": grads,
             **{f"buckets {c} MB": sum(r.buffer_bytes for r in reducers[c]) for c in CAPS}}  # fmt: skip
    names = list(variants)
    times = {n: [] for n in names}
    exposed = {n: [] for n in names}
    step = 1
    for warm in names:  # every variant once, untimed
        run.parts.reducers = variants[warm]
        run.step(step)
        step += 1
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            run.parts.reducers = variants[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            run.step(step)
            sync()
            times[name].append(time.perf_counter() - t0)
            exposed[name].append(marks["update_start"] - marks["backward_end"])
            step += 1
    return {"times": times, "exposed": exposed, "extra_bytes": extra, "grad_bytes": grads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="steps of each variant (default 6)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one GPU per rank, NCCL (needs 4 GPUs for dp2 x tp2)")  # fmt: skip
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    head = print_header()
    result = {**head, "rounds": args.rounds, "layouts": {}}
    for label, world, tp in (("dp2", 2, 1), ("dp2 x tp2", 4, 2)):
        if args.device == "cuda" and torch.cuda.device_count() < world:
            print(f"\n{label}: skipped, needs {world} GPUs ({torch.cuda.device_count()} visible)")
            continue
        r = launch(world, rank_main, tp, args.rounds, args.device, cuda=args.device == "cuda",
                   timeout=1800)[0]  # fmt: skip
        med = {n: (statistics.median(r["times"][n]), statistics.median(r["exposed"][n]))
               for n in r["times"]}  # fmt: skip
        flat_step, flat_exposed = med["flat"]
        print(f"\n{label}: gradients {r['grad_bytes'] / 2**20:.0f} MiB per rank")
        print(f"{'variant':>16} {'step s':>8} {'exposed s':>10} {'vs flat':>8} {'extra MiB':>10}")
        rows = {}
        for n, (t, e) in med.items():
            rows[n] = {"step_s": t, "exposed_s": e, "exposed_over_flat": e / flat_exposed,
                       "step_over_flat": t / flat_step, "extra_bytes": r["extra_bytes"][n]}  # fmt: skip
            print(f"{n:>16} {t:8.3f} {e:10.3f} {e / flat_exposed:8.2f} "
                  f"{r['extra_bytes'][n] / 2**20:10.1f}")  # fmt: skip
        result["layouts"][label] = {"grad_bytes": r["grad_bytes"], "variants": rows,
                                    "raw": {"times": r["times"], "exposed": r["exposed"]}}  # fmt: skip
    out = results_dir(args.publish) / "overlap.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
