"""The peer-shaped 3D comparison of benchmarks/throughput.py (`--peer`): how much of one process's
throughput mesh3d keeps at dp=tp=pp=2 and at tp=2 alone, on the shape peers report 3D numbers for.

    python benchmarks/throughput.py --peer          # ~20 minutes here
    python benchmarks/throughput.py --peer --tiny   # toy shapes, for the test

Shape: Llama hidden 256, ffn 1024, 4 layers, GQA 4 q / 2 kv heads, vocab 512 (tied), sequence 128,
fp32; 32 sequences = 4,096 tokens per step in microbatches of 4 sequences; 20 steps, reported as
the median tokens/s of steps 3-20. Every run is a fresh process (or torchrun group), one intra-op
thread per rank unless said (an in-process 1x1x1 run slowed step by step after other work in
the process):
  - mesh3d 1x1x1: `recipes/train.py` on 1 torchrun rank, 8 microbatches, once with as many
    intra-op threads as the machine has cores (the baseline: the one process a user runs) and
    once with one thread (kept beside it, labelled),
  - mesh3d 2x2x2, tp_mode REDUCE_SCATTER and ALL_REDUCE: 8 gloo ranks, 4 microbatches a replica,
  - mesh3d tp=2 alone, both tp_modes: 2 ranks, 8 microbatches,
  - throughput.py's plain loop (b) at 1x1x1: this file run as a script,
  - with `--picotron DIR`, Hugging Face Picotron's own training step at 1x1x1 on every core and
    at 2x2x2 (`_picotron.py`: its train.py unmodified, on CPU with gloo), in the same
    interleaved repetitions: `mesh3d_over_picotron` is mesh3d 2x2x2's tokens/s over
    Picotron's, per repetition and their median (Picotron's losses are listed, not compared:
    its initialization differs per layout).
mesh3d's tokens/s are the ones its metrics file logs (the last stage's step time). The ways run
one after the other, in reversed order every other repetition; efficiency = tokens/s of a layout /
tokens/s of mesh3d 1x1x1 on every core in the same repetition, reported per repetition and as
their median (and over the one-thread 1x1x1 beside it).
Every mesh3d run trains the same model on the same batches, so all must log the same first and
last loss (1e-4 relative; the plain loop keeps the LR constant, so only its first loss counts):
the benchmark exits 1 when they do not.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _ways import (
    COMMON,
    CONFIG,
    ROOT,
    SHAPES,
    loop_stepper,
    plain_model,
    shape_overrides,
    step_batches,
    torchrun_train,
)

from mesh3d.config import load_config

# mode -> (steps, first steps left out, repetitions)
SCHEDULE = {"peer": (20, 2, 3), "peer_tiny": (4, 1, 1)}
# way -> (system, (dp, tp, pp), tp_mode)
WAYS = {
    "mesh3d_1x1x1_cores": ("mesh3d", (1, 1, 1), None),  # threads = cores: what a user runs
    "mesh3d_1x1x1": ("mesh3d", (1, 1, 1), None),
    "plain_1x1x1": ("plain", (1, 1, 1), None),
    "mesh3d_2x2x2_reduce_scatter": ("mesh3d", (2, 2, 2), "REDUCE_SCATTER"),
    "mesh3d_2x2x2_all_reduce": ("mesh3d", (2, 2, 2), "ALL_REDUCE"),
    "mesh3d_tp2_reduce_scatter": ("mesh3d", (1, 2, 1), "REDUCE_SCATTER"),
    "mesh3d_tp2_all_reduce": ("mesh3d", (1, 2, 1), "ALL_REDUCE"),
}
# with --picotron: Picotron's own step at the same shape (`_picotron.py`)
PICOTRON_WAYS = {
    "picotron_1x1x1_cores": ("picotron", (1, 1, 1), None),
    "picotron_2x2x2": ("picotron", (2, 2, 2), None),
}
THREADS = {
    "mesh3d_1x1x1_cores": os.cpu_count() or 1,
    "picotron_1x1x1_cores": os.cpu_count() or 1,
}  # the others: one thread per rank
BASELINE = "mesh3d_1x1x1_cores"  # efficiency against the one-process run on every core
ONE_THREAD = "mesh3d_1x1x1"  # the one-thread 1x1x1, kept beside it (efficiency_one_thread)
# --tiny (the test): every layout and tp_mode once, not every pair (8 ranks start in ~30 s here)
TINY_WAYS = ("mesh3d_1x1x1_cores", "mesh3d_1x1x1", "plain_1x1x1", "mesh3d_2x2x2_reduce_scatter",
             "mesh3d_tp2_all_reduce")  # fmt: skip
LOSS_RTOL = 1e-4
TARGETS = {"tp2": 0.85}  # tokens/s at tp=2 (2 ranks) / at 1x1x1


def overrides(mode: str, steps: int) -> list[str]:
    """The config of `mode` at 1x1x1."""
    return [*COMMON, *shape_overrides(mode), f"tokens.train_steps={steps}"]


def layout_overrides(mode: str, dims: tuple[int, int, int], tp_mode: str | None) -> list[str]:
    """`dims` = (dp, tp, pp) at the global batch of 1x1x1: dp divides the accumulation."""
    dp, tp, pp = dims
    acc = SHAPES[mode][-1]
    out = [f"parallelism.dp={dp}", f"parallelism.tp={tp}", f"parallelism.pp={pp}",
           f"tokens.batch_accumulation_per_replica={acc // dp}"]  # fmt: skip
    return out + ([f"parallelism.tp_mode={tp_mode}"] if tp_mode else [])


def run_way(way: str, mode: str, steps: int, picotron: Path | None = None) -> dict:
    """One run of `way` in fresh processes: tokens/s and loss of every step, wall seconds."""
    system, dims, tp_mode = {**WAYS, **PICOTRON_WAYS}[way]
    if system == "picotron":
        from _picotron import run_picotron

        return run_picotron(picotron, SHAPES[mode], dims, steps, THREADS.get(way, 1))
    if system == "mesh3d":
        ranks = math.prod(dims)
        layout = layout_overrides(mode, dims, tp_mode)
        metrics, wall = torchrun_train(ranks, overrides(mode, steps) + layout, THREADS.get(way, 1))
        return dict(ranks=ranks, threads=THREADS.get(way, 1), wall_s=wall, step_tokens_per_sec=[m["tokens_per_sec"] for m in metrics],
                    losses=[m["lm_loss"] for m in metrics])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mesh3d-peer-") as tmp:
        out = Path(tmp) / "plain.json"
        cmd = [sys.executable, __file__, mode, str(steps), str(out)]
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"plain loop failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return dict(ranks=1, wall_s=time.time() - t0, **json.loads(out.read_text()))


def plain_main(mode: str, steps: int, out: Path) -> None:
    """The plain loop at 1x1x1 on one thread: tokens/s and loss of every step, to `out`."""
    torch.set_num_threads(1)
    cfg = load_config(CONFIG, overrides(mode, steps))
    batches = step_batches(cfg, steps)
    step = loop_stepper(plain_model(cfg), lambda m, x: m(x), cfg, batches)
    tokens = sum(x.numel() for x, _ in batches[0])
    seconds, losses = zip(*(step(k) for k in range(1, steps + 1)), strict=True)
    out.write_text(json.dumps(dict(step_tokens_per_sec=[tokens / s for s in seconds],
                                   losses=list(losses))))  # fmt: skip


def loss_parity(runs: dict[str, list[dict]]) -> dict:
    """Largest relative difference of every run's first (and, for mesh3d, last) loss from the
    first mesh3d 1x1x1 run's, and whether both are within `LOSS_RTOL`."""
    ref = runs[BASELINE][0]["losses"]
    first = last = 0.0
    for way, reps in runs.items():
        if way in PICOTRON_WAYS:  # its own initialization: not the same losses
            continue
        for run in reps:
            first = max(first, abs(run["losses"][0] - ref[0]) / abs(ref[0]))
            if WAYS[way][0] == "mesh3d":
                last = max(last, abs(run["losses"][-1] - ref[-1]) / abs(ref[-1]))
    return dict(rtol=LOSS_RTOL, max_rel_diff_first=first, max_rel_diff_last=last,
                ok=first <= LOSS_RTOL and last <= LOSS_RTOL)  # fmt: skip


def efficiencies(runs: dict[str, list[dict]], baseline: str = BASELINE) -> dict[str, dict]:
    """way -> its tokens/s / `baseline`'s (mesh3d 1x1x1 on every core), per repetition and
    their median."""
    base = [r["tokens_per_sec_median"] for r in runs[baseline]]
    out = {}
    for way, reps in runs.items():
        per_rep = [r["tokens_per_sec_median"] / b for r, b in zip(reps, base, strict=True)]
        out[way] = dict(per_repetition=per_rep, median=statistics.median(per_rep))
    return out


def run_peer(tiny: bool, picotron: Path | None = None) -> dict:
    """Every way (and Picotron's with `picotron`, a checkout), `SCHEDULE`'s repetitions of each;
    the result (see `table`)."""
    mode = "peer_tiny" if tiny else "peer"
    steps, skip, reps = SCHEDULE[mode]
    ways = list(TINY_WAYS if tiny else WAYS) + (list(PICOTRON_WAYS) if picotron else [])
    print(f"config: {' '.join(overrides(mode, steps))}\n{steps} steps, median of steps "
          f"{skip + 1}-{steps}; {reps} repetitions of {len(ways)} ways", flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for rep in range(reps):
        for way in ways if rep % 2 == 0 else ways[::-1]:
            run = run_way(way, mode, steps, picotron)
            run["tokens_per_sec_median"] = statistics.median(run["step_tokens_per_sec"][skip:])
            runs[way].append(run)
            print(f"repetition {rep + 1} {way}: {run['tokens_per_sec_median']:.0f} tokens/s, "
                  f"loss {run['losses'][0]:.6f} -> {run['losses'][-1]:.6f}, "
                  f"{run['wall_s']:.0f} s", flush=True)  # fmt: skip
    every = {**WAYS, **PICOTRON_WAYS}
    extra = over_picotron(runs) if picotron else {}
    return dict(mode=mode, shape=SHAPES[mode], overrides=overrides(mode, steps), steps=steps,
                skipped_steps=skip, repetitions=reps, ways={w: list(every[w]) for w in ways},
                picotron=str(picotron) if picotron else None, **extra,
                layouts={w: layout_overrides(mode, every[w][1], every[w][2]) for w in ways},
                runs=runs, efficiency=efficiencies(runs),
                efficiency_one_thread=efficiencies(runs, ONE_THREAD), loss_parity=loss_parity(runs),
                targets=TARGETS)  # fmt: skip


def over_picotron(runs: dict[str, list[dict]]) -> dict:
    """mesh3d's tokens/s over Picotron's, per repetition and their median: each mesh3d 2x2x2
    tp_mode and 1x1x1 over Picotron's same layout; and Picotron's own efficiency (2x2x2 over
    its 1x1x1 on every core)."""

    def ratio(a: str, b: str) -> dict:
        per = [x["tokens_per_sec_median"] / y["tokens_per_sec_median"]
               for x, y in zip(runs[a], runs[b], strict=True)]  # fmt: skip
        return dict(per_repetition=per, median=statistics.median(per))

    pairs = {f"{w}_over_picotron": (w, "picotron_2x2x2") for w in runs
             if w.startswith("mesh3d_2x2x2")}  # fmt: skip
    pairs["mesh3d_1x1x1_cores_over_picotron"] = ("mesh3d_1x1x1_cores", "picotron_1x1x1_cores")
    pairs["picotron_efficiency"] = ("picotron_2x2x2", "picotron_1x1x1_cores")
    return dict(mesh3d_over_picotron={k: ratio(*ab) for k, ab in pairs.items() if ab[0] in runs})


def _cell(values: list[float], fmt: str) -> str:
    """'median (rep 1, rep 2, ...)'."""
    each = ", ".join(format(v, fmt) for v in values)
    return f"{format(statistics.median(values), fmt)} ({each})"


def table(result: dict) -> str:
    """Markdown: tokens/s at 1x1x1 and at 2x2x2 / tp=2 with efficiencies; losses per way."""
    runs, eff = result["runs"], result["efficiency"]

    def tps(way: str) -> str:
        return _cell([r["tokens_per_sec_median"] for r in runs[way]], ".0f")

    one = result.get("efficiency_one_thread", eff)

    def rows(dims: tuple[int, int, int], per_rank: bool) -> list[str]:
        out = []
        for way in (w for w in runs if w in WAYS and WAYS[w][1] == dims):
            e = eff[way]
            row = (f"| mesh3d, tp_mode {WAYS[way][2]} | {tps(BASELINE)} | {tps(way)} | "
                   f"{_cell(e['per_repetition'], '.3f')} | {one[way]['median']:.3f} |")  # fmt: skip
            out.append(row + (f" {e['median'] / math.prod(dims):.3f} |" if per_rank else ""))
        return out

    cores = runs[BASELINE][0].get("threads", "all")
    lines = ["tokens/s: median of repetitions (each repetition's median over steps)",
             f"efficiency: over mesh3d 1×1×1 on {cores} threads (one process using the machine); "
             f"beside it, over the one-thread 1×1×1 ({tps(ONE_THREAD)} tokens/s)", "",
             "| system | 1×1×1 | 2×2×2 | efficiency | over 1 thread |", "|---|---|---|---|---|",
             *rows((2, 2, 2), False), f"| plain torch loop | {tps('plain_1x1x1')} | — | — | — |",
             "", "| system | 1×1×1 | tp=2 (2 ranks) | efficiency | over 1 thread | per rank (÷ 2) |",
             "|---|---|---|---|---|---|", *rows((1, 2, 1), True)]  # fmt: skip
    if result.get("mesh3d_over_picotron"):
        lines += ["", f"Picotron ({result['picotron']}) in the same repetitions: "
                  f"1×1×1 on {cores} threads {tps('picotron_1x1x1_cores')}, 2×2×2 "
                  f"{tps('picotron_2x2x2')} tokens/s", "", "| ratio | median (per repetition) |",
                  "|---|---|"]  # fmt: skip
        for key, r in result["mesh3d_over_picotron"].items():
            lines.append(f"| {key} | {_cell(r['per_repetition'], '.3f')} |")
    lines += ["", "| run | step-1 loss | last loss |", "|---|---|---|"]
    for way, reps in runs.items():
        firsts = sorted({f"{r['losses'][0]:.6f}" for r in reps})
        lasts = sorted({f"{r['losses'][-1]:.6f}" for r in reps})
        lines.append(f"| {way} | {' / '.join(firsts)} | {' / '.join(lasts)} |")
    p = result["loss_parity"]
    lines.append(f"\nloss parity (rtol {p['rtol']:g}): first {p['max_rel_diff_first']:.2e}, "
                 f"last {p['max_rel_diff_last']:.2e} -> {'ok' if p['ok'] else 'FAILED'}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":  # the plain loop's fresh process: MODE STEPS OUT
    plain_main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
