"""Where a parallel step's time goes, per axis: aten kernels, DTensor dispatch, collectives, rest.

    python benchmarks/overhead.py               # 1x1x1, tp2 (both modes), dp2, pp2, 2x2x2
    python benchmarks/overhead.py --quick       # toy shapes, two layouts (for the test)

The shape of issue 20's peer comparison: Llama hidden 256, ffn 1024, 4 layers, GQA 4/2, vocab
512, seq 128, fp32, a global batch of 32 sequences (4,096 tokens) in microbatches of 4. Each
layout runs on fresh forked ranks (`_ranks.launch`: gloo, one thread each) through mesh3d's
training path (`mesh3d.train.run.Run`: `Run.prepare` / `run.step`): 4 steps to warm up, then one step under
torch.profiler (CPU). Rank 0's events are put in classes by name:
- kernels: every `aten::` op's self time (the work, plus the copies DTensor and the
  collectives make);
- DTensor: the self time of the Python-side events of a DTensor op (`PythonSubclass`, the
  `to_local` / `from_local` autograd functions and their backwards, `Redistribute`), and how
  many DTensor ops dispatched (`PythonSubclass` events);
- collectives: `c10d::` / `_c10d_functional::` / gloo events, including `wait_tensor` (time
  waiting for the other ranks: on an oversubscribed host mostly their being descheduled);
- rest: the step's wall time minus the above (Python, autograd engine, the profiler itself).
Also printed: the unprofiled median step time of steps 2-4 and its tokens/s. The profile slows
small ops more than big ones and a 2-core host runs 8 ranks in turn, so the shares are
indicative; the DTensor op count is exact. Raw numbers: `benchmarks/results/local/overhead[_quick].json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _ranks import launch
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path

from mesh3d.config import load_config

LAYOUTS = {  # name -> (dp, tp, pp, tp_mode)
    "1x1x1": (1, 1, 1, "ALL_REDUCE"),
    "tp2 all-reduce": (1, 2, 1, "ALL_REDUCE"),
    "tp2 reduce-scatter": (1, 2, 1, "REDUCE_SCATTER"),
    "dp2": (2, 1, 1, "ALL_REDUCE"),
    "pp2 1f1b": (1, 1, 2, "ALL_REDUCE"),
    "2x2x2 reduce-scatter": (2, 2, 2, "REDUCE_SCATTER"),
}
QUICK = ("1x1x1", "tp2 all-reduce")
# hidden, ffn, layers, heads, kv heads, vocab, seq, global batch, micro batch
SHAPE = {
    "default": (256, 1024, 4, 4, 2, 512, 128, 32, 4),
    "quick": (64, 128, 2, 4, 2, 128, 32, 8, 2),
}
_DTENSOR = {"PythonSubclass", "_FromTorchTensor", "_ToTorchTensor", "_FromTorchTensorBackward",
            "_ToTorchTensorBackward", "Redistribute", "NestedRedistribute"}  # fmt: skip


def overrides(layout: tuple, shape: tuple) -> list[str]:
    dp, tp, pp, mode = layout
    h, ffn, layers, heads, kv, vocab, seq, gbs, mbs = shape
    mc = "model.model_config"
    return [f"{mc}.hidden_size={h}", f"{mc}.intermediate_size={ffn}",
            f"{mc}.num_hidden_layers={layers}", f"{mc}.num_attention_heads={heads}",
            f"{mc}.num_key_value_heads={kv}", f"{mc}.vocab_size={vocab}",
            f"{mc}.max_position_embeddings={seq}", f"{mc}.tie_word_embeddings=false",
            f"tokens.sequence_length={seq}", f"tokens.micro_batch_size={mbs}",
            f"tokens.batch_accumulation_per_replica={gbs // (dp * mbs)}", "tokens.train_steps=10",
            f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
            f"parallelism.tp_mode={mode}", "parallelism.pp_engine=1f1b",
            "logging.log_level=warning", "mesh3d.device=cpu", "mesh3d.dummy_data=random",
            "mesh3d.wandb=false", "model.dtype=float32", "model.make_vocab_size_divisible_by=1",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1"]  # fmt: skip


def classify(name: str) -> str:
    if name.startswith("aten::"):
        return "kernels"
    if name in _DTENSOR:
        return "DTensor"
    if name.startswith(("c10d::", "_c10d_functional::", "gloo:")) or "all_reduce" in name:
        return "collectives"
    return "other"


def _rank(rank: int, world: int, cfg_path: str, ovr: list[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from mesh3d.train.run import Run

    run = Run.prepare(load_config(cfg_path, ovr))
    seconds = []
    for k in range(1, 5):
        dist.barrier()
        t0 = time.perf_counter()
        loss = run.step(k).loss
        seconds.append(time.perf_counter() - t0)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run.step(5)
        wall = time.perf_counter() - t0
    self_s: dict[str, float] = collections.defaultdict(float)
    dtensor_ops = 0
    for ev in prof.events():
        self_s[classify(ev.name)] += ev.self_cpu_time_total / 1e6
        dtensor_ops += ev.name == "PythonSubclass"
    shares = {k: self_s[k] for k in ("kernels", "DTensor", "collectives")}
    shares["rest"] = max(0.0, wall - sum(shares.values()))
    return {"step_s": statistics.median(seconds[1:]), "wall_s": wall, "seconds": shares,
            "dtensor_ops": dtensor_ops, "loss": loss}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="toy shapes, 1x1x1 and tp2 (the test)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results[/local]/overhead*.json)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    from pathlib import Path

    cfg_path = str(Path(__file__).resolve().parents[1] / "recipes/configs/cpu_tiny.yaml")
    shape = SHAPE["quick" if args.quick else "default"]
    names = QUICK if args.quick else tuple(LAYOUTS)
    tokens = shape[6] * shape[7]
    print(f"torch {torch.__version__}; shape {shape}; {tokens} tokens per step; rank 0's profile")
    print(
        "| layout | ranks | step ms | tokens/s | DTensor ops | kernels % | DTensor % "
        "| collectives % | rest % |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    losses, rows = {}, {}
    for name in names:
        dp, tp, pp, _ = LAYOUTS[name]
        world = dp * tp * pp
        r = launch(world, _rank, cfg_path, overrides(LAYOUTS[name], shape), timeout=900)[0]
        pct = {k: 100 * v / r["wall_s"] for k, v in r["seconds"].items()}
        losses[name], rows[name] = r["loss"], dict(r, ranks=world)
        print(f"| {name} | {world} | {1000 * r['step_s']:.0f} | {tokens / r['step_s']:,.0f} | "
              f"{r['dtensor_ops']:,} | {pct['kernels']:.0f} | {pct['DTensor']:.0f} | "
              f"{pct['collectives']:.0f} | {pct['rest']:.0f} |", flush=True)  # fmt: skip
    out = args.out or results_dir(args.publish) / f"overhead{'_quick' if args.quick else ''}.json"
    with open(out, "w") as fh:
        json.dump(
            {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "torch": torch.__version__,
                "shape": shape,
                "layouts": rows,
            },
            fh,
            indent=1,
        )
    print(f"wrote {out}")
    first = next(iter(losses.values()))
    print("step-4 loss per layout: " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    same = all(abs(v - first) <= 1e-4 * abs(first) for v in losses.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
