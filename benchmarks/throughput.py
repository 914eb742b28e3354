"""Training throughput of mesh3d against a plain PyTorch loop and Hugging Face transformers.

    python benchmarks/throughput.py               # "quick": ~13.7M-parameter Llama, 10 rounds, minutes
    python benchmarks/throughput.py --full        # the same, 40 rounds (the published numbers)
    python benchmarks/throughput.py --no-compile  # without the compiled ways (a', c')
    python benchmarks/throughput.py --tiny        # a toy model, no compile, for the test (seconds)
    python benchmarks/throughput.py --profile     # also: torch.profiler top ops of one step each
    python benchmarks/throughput.py --peer        # only the peer-shaped 3D comparison (_peer.py)
    python benchmarks/throughput.py --peer --picotron DIR   # and Picotron's step beside it (_picotron.py)

In one process, the same Llama shapes train from the same initial weights on the same batches,
five ways, interleaved step by step (round k runs step k of each way, in an order that rotates
every round, so each way is first, second, ... about equally often):
  (a) mesh3d at dp=tp=pp=1: the run `mesh3d.train` builds (`Run.prepare`), stepped by the
      function its loop calls every step (`run.step`: read the batch, forward/backward per
      microbatch, clip, AdamW, LR schedule); the loop's logging is not timed,
  (b) a plain loop over the same model class (`mesh3d.models.llama.Llama`): sum cross-entropy /
      tokens per microbatch, `clip_grad_norm_`, the same microbatching and dtype,
  (c) transformers' `LlamaForCausalLM` (config from the Llama spec's HF translation, SDPA, fp32, weights
      copied from (b)) in the same loop as (b),
  (a') (a) with `mesh3d.compile=true`: mesh3d compiles each layer's attention, MLP and norms,
  (c') (c) with `model.compile()` on the whole `LlamaForCausalLM`, what `torch_compile=True` in
      HF's Trainer does (the loss stays outside, as in (c)).
(a') and (c') compile in round 1 (~30 s each here), which the warm-up rounds leave out.
All of them use torch's AdamW with the config's settings, fused as its `torch_adam_is_fused: true`
asks (HF Trainer's default optimizer on torch >= 2.8, `adamw_torch_fused`, is the same kernel).
Reported: median tokens/s after the warm-up rounds, and the ratios in `TARGETS` (a/b, a/c, a'/c,
a'/c') as the ratio of those medians and as the median of the per-round ratios (with a bootstrap
95% interval): a round's steps run within seconds of each other, so the per-round ratio cancels
the slow drifts of a shared machine's load. mesh3d's steps include reading its dummy batch; the
loops get theirs ready-made. All ways run on one intra-op thread by default (`--threads`): on a
busy 2-core machine, a process's second OpenMP thread stalls whenever another process takes its
core, and steps then vary 10-50x.

Then scaling, at the same global batch: mesh3d at dp=tp=pp=1 in this process on every core, and
at dp=tp=pp=2 on 8 CPU ranks (torchrun, `recipes/train.py`, one thread each); efficiency = tokens/s
at 8 ranks / tokens/s at 1 rank. With fewer than 8 cores the ranks oversubscribe the machine, so
the number measures what the 3D layout costs (communication, pipeline bubble), not a speed-up.
Raw numbers: `benchmarks/results/local/throughput[_peer][_tiny].json` (`--publish`:
`benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path when a script runs
from _ways import (
    COMMON,
    CONFIG,
    ROOT,
    SHAPES,
    Stepper,
    plain_model,
    shape_overrides,
    step_batches,
    steppers,
    torchrun_train,
)

from mesh3d.config import global_batch_size, load_config
from mesh3d.models.llama import num_params
from mesh3d.train.loop import train

# name -> (interleaved rounds, warm-up rounds skipped, steps at 8 ranks)
SCHEDULE = {"quick": (10, 2, 4), "full": (40, 2, 6), "tiny": (4, 1, 3)}


def run_mesh3d(cfg) -> list[float]:
    """tokens/s of every step of `mesh3d.train.loop.train` on this process."""
    return [m["tokens_per_sec"] for m in train(cfg).metrics]


def interleave(ways: dict[str, Stepper], n_steps: int) -> dict[str, dict]:
    """Steps 1..n of every way, round k running step k of each in an order rotated by k."""
    names = list(ways)
    out = {name: dict(step_seconds=[], losses=[]) for name in names}
    for k in range(1, n_steps + 1):
        shift = k % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            seconds, loss = ways[name](k)
            out[name]["step_seconds"].append(seconds)
            out[name]["losses"].append(loss)
        print(f"round {k:3d}: " + "  ".join(
            f"{n} {out[n]['step_seconds'][-1] * 1e3:6.0f} ms" for n in names), flush=True)  # fmt: skip
    return out


def profile(ways: dict[str, Stepper], k: int) -> None:
    """Print the top CPU ops of step k of each way (call after warm-up steps)."""
    from torch.profiler import profile as torch_profile

    for name, step in ways.items():
        with torch_profile() as prof:
            step(k)
        print(f"\n--- {name}: step {k}, top ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def scaling(mode: str, steps: int, warmup: int, extra: list[str]) -> dict:
    """mesh3d 1x1x1 in this process on every core, then 2x2x2 on 8 torchrun ranks of 1 thread
    each (`recipes/train.py`), at the same global batch; tokens/s of every step of both."""
    h, ffn, layers, heads, kv, vocab, seq, mbs, acc = SHAPES[mode]
    gbs, cores = mbs * acc, os.cpu_count() or 1
    base = [*COMMON, *shape_overrides(mode), *extra, f"tokens.train_steps={steps}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        one = run_mesh3d(load_config(CONFIG, base))
    finally:
        torch.set_num_threads(threads)
    layout = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2",
              f"tokens.micro_batch_size={gbs // 4}", "tokens.batch_accumulation_per_replica=2"]  # fmt: skip
    metrics, wall = torchrun_train(8, [*base, *layout])
    eight = [m["tokens_per_sec"] for m in metrics]
    med1, med8 = statistics.median(one[warmup:]), statistics.median(eight[warmup:])
    return dict(global_batch_size=gbs, warmup_steps=warmup, cores=cores, oversubscribed=cores < 8,
                one_rank=dict(layout="dp=1 tp=1 pp=1", threads=cores, micro_batch_size=mbs,
                              step_tokens_per_sec=one, tokens_per_sec_median=med1),
                eight_ranks=dict(layout="dp=2 tp=2 pp=2", threads_per_rank=1, launcher="torchrun",
                                 micro_batch_size=gbs // 4, wall_s=wall, overrides=layout,
                                 step_tokens_per_sec=eight, tokens_per_sec_median=med8),
                efficiency=med8 / med1)  # fmt: skip


def bootstrap_median(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of `values` (fixed seed: reproducible)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(len(values), (n, len(values)), generator=g)
    medians = x[idx].median(dim=1).values.sort().values
    return float(medians[int(0.025 * n)]), float(medians[int(0.975 * n) - 1])


# (way, other way) -> the target for way's tokens/s / the other's
TARGETS = {("mesh3d", "plain"): 0.97, ("mesh3d", "transformers"): 1.0,
           ("mesh3d_compiled", "transformers"): 1.15,
           ("mesh3d_compiled", "transformers_compiled"): 1.0}  # fmt: skip


def summarize(impls: dict, tokens: int, warmup: int) -> dict:
    """tokens/s per step and their median per way; the ratios of `TARGETS` whose ways ran."""
    for m in impls.values():
        m["step_tokens_per_sec"] = [tokens / s for s in m["step_seconds"]]
        m["tokens_per_sec_median"] = statistics.median(m["step_tokens_per_sec"][warmup:])
        m["loss_step1"], m["loss_last"] = m["losses"][0], m["losses"][-1]
    ratios = {}
    for (way, other), target in TARGETS.items():
        if way not in impls or other not in impls:
            continue
        mine, theirs, key = impls[way], impls[other], f"{way}_over_{other}"
        ratios[key] = mine["tokens_per_sec_median"] / theirs["tokens_per_sec_median"]
        # tokens/s ratio of the same round = their step time / mine
        per_round = [b / a for a, b in zip(mine["step_seconds"], theirs["step_seconds"])][warmup:]
        ratios[f"{key}_per_round"] = per_round
        ratios[f"{key}_paired"] = statistics.median(per_round)
        ratios[f"{key}_paired_ci95"] = bootstrap_median(per_round)
        ratios[f"{key}_target"] = target
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes and few steps (for tests)")
    ap.add_argument("--steps", type=int, help="interleaved rounds (one step of each way)")
    ap.add_argument("--full", action="store_true",
                    help="40 rounds instead of 10 (over 15 minutes on a loaded 2-core host)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for (a, b, c)")
    ap.add_argument("--no-scaling", action="store_true", help="skip the 8-rank 2x2x2 run")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction,
                    help="add the compiled ways (default: yes, but not with --tiny)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="print top ops of one step of each")
    ap.add_argument(
        "--peer",
        action="store_true",
        help="only the peer-shaped 3D comparison (_peer.py: own shapes, steps)",
    )
    ap.add_argument(
        "--picotron",
        type=Path,
        metavar="DIR",
        help="with --peer: also Hugging Face Picotron's step from the checkout DIR (_picotron.py)",
    )
    ap.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/results/local/throughput*.json)"
    )
    add_publish_flag(ap)
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides, key=value")
    args = ap.parse_args(argv)
    if args.picotron is not None:
        from _picotron import PicotronMissing, check_checkout

        if not args.peer:
            ap.error("--picotron is a peer way: add --peer")
        try:
            args.picotron = check_checkout(args.picotron)
        except PicotronMissing as e:
            ap.error(str(e))
    mode, suffix = ("tiny", "_tiny") if args.tiny else ("quick", "")
    n_steps, warmup, scale_steps = SCHEDULE["full" if args.full and not args.tiny else mode]
    n_steps = args.steps or n_steps
    compiled = not args.tiny if args.compile is None else args.compile
    torch.set_num_threads(args.threads)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cores = os.cpu_count()
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"torch {torch.__version__} | cores {cores} | threads {args.threads} | {now}")
    header = dict(command=sys.argv, torch=torch.__version__, cores=cores, date=now)
    if args.peer:
        return peer_main(args, header)
    import transformers

    overrides = [*COMMON, *shape_overrides(mode), f"tokens.train_steps={n_steps}", *args.overrides]
    cfg = load_config(CONFIG, overrides)
    steps = step_batches(cfg, n_steps)
    gbs, seq = global_batch_size(cfg), cfg.tokens.sequence_length
    names = ("hidden_size", "intermediate_size", "num_layers", "heads", "kv_heads", "vocab_size",
             "sequence_length", "micro_batch_size", "accumulation")  # fmt: skip
    shapes = dict(zip(names, SHAPES[mode]), parameters=num_params(plain_model(cfg)),
                  tokens_per_step=gbs * seq)  # fmt: skip
    print(f"config: {CONFIG.relative_to(ROOT)} + {' '.join(overrides)}")
    print(f"model: {shapes['parameters'] / 1e6:.1f}M parameters (tied embeddings), fp32; "
          f"{gbs} x {seq} = {gbs * seq} tokens per step in {len(steps[0])} microbatches; "
          f"{n_steps} interleaved rounds, the first {warmup} skipped\n")  # fmt: skip
    t_all, load0 = time.time(), os.getloadavg()
    compiled_cfg = load_config(CONFIG, [*overrides, "mesh3d.compile=true"]) if compiled else None
    ways = steppers(cfg, steps, compiled_cfg)
    impls = interleave(ways, n_steps)
    if args.profile:
        profile(ways, n_steps)  # one more step each (the batches of the last step again)
    result = dict(header, transformers=transformers.__version__, threads=args.threads, mode=mode,
                  config=str(CONFIG.relative_to(ROOT)), overrides=overrides, shapes=shapes,
                  steps=n_steps, warmup_steps=warmup, compiled=compiled, impls=impls,
                  ratios=summarize(impls, gbs * seq, warmup))  # fmt: skip
    if not args.no_scaling:
        print(f"\n2x2x2 on 8 ranks vs 1x1x1: {cores} cores, so the 8 ranks (1 thread each) "
              f"oversubscribe them {8 / cores:g}x; 1x1x1 runs here on {cores} threads", flush=True)  # fmt: skip
        s = scaling(mode, scale_steps, warmup, args.overrides)
        result["scaling"] = s
        for key in ("one_rank", "eight_ranks"):
            steps_s = " ".join(f"{v:.0f}" for v in s[key]["step_tokens_per_sec"])
            print(f"{s[key]['layout']}: steps {steps_s} tokens/s")
    print("\n" + table(result))
    write(result, t_all, load0, args.out or results_dir(args.publish) / f"throughput{suffix}.json")
    return 0


def peer_main(args: argparse.Namespace, header: dict) -> int:
    """`--peer`: the peer-shaped 3D comparison (`_peer.py`); 1 when the losses differ."""
    from _peer import run_peer
    from _peer import table as peer_table

    t_all, load0 = time.time(), os.getloadavg()
    result = dict(header, **run_peer(args.tiny, args.picotron))
    print("\n" + peer_table(result))
    suffix = "_tiny" if args.tiny else ""
    out = args.out or results_dir(args.publish) / f"throughput_peer{suffix}.json"
    write(result, t_all, load0, out)
    return 0 if result["loss_parity"]["ok"] else 1


def write(result: dict, t_all: float, load0: tuple[float, ...], out: Path) -> None:
    """Add the run's time and load to `result` and write it to `out` as JSON."""
    result.update(total_s=time.time() - t_all, loadavg_start=load0, loadavg_end=os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ntotal {result['total_s']:.0f}s; load average {load0[0]:.1f} -> "
          f"{result['loadavg_end'][0]:.1f}; wrote {out}")  # fmt: skip


def table(result: dict) -> str:
    """The results as Markdown: median tokens/s and losses per way, then the targeted ratios."""
    impls, ratios = result["impls"], result["ratios"]
    lines = ["| way | tokens/s (median) | step-1 loss | last loss |", "|---|---|---|---|"]
    for name, m in impls.items():
        lines.append(f"| {name} | {m['tokens_per_sec_median']:.0f} | {m['loss_step1']:.5f} | "
                     f"{m['loss_last']:.5f} |")  # fmt: skip
    lines += ["", "| ratio of tokens/s | of medians | per round: median [95% CI] | target |",
              "|---|---|---|---|"]  # fmt: skip
    for way, other in TARGETS:
        key = f"{way}_over_{other}"
        if key in ratios:
            lo, hi = ratios[f"{key}_paired_ci95"]
            lines.append(f"| {way} / {other} | {ratios[key]:.3f} | "
                         f"{ratios[f'{key}_paired']:.3f} [{lo:.3f}, {hi:.3f}] | "
                         f"≥ {ratios[f'{key}_target']:g} |")  # fmt: skip
    s = result.get("scaling")
    if s:
        one, eight = s["one_rank"], s["eight_ranks"]
        lines += ["", "| mesh3d layout | ranks x threads | tokens/s (median) | efficiency |",
                  "|---|---|---|---|",
                  f"| 1x1x1 | 1 x {one['threads']} | {one['tokens_per_sec_median']:.0f} | 1 |",
                  f"| 2x2x2 | 8 x 1 | {eight['tokens_per_sec_median']:.0f} | "
                  f"{s['efficiency']:.3f} |"]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
