"""Where a training step's time goes, per phase, at 1x1x1 and at dp=tp=pp=2 (issue 34).

    python benchmarks/step_breakdown.py            # peer shape, 12 steps per layout (~3 minutes)
    python benchmarks/step_breakdown.py --tiny     # toy shapes (the test)

The peer shape of `throughput.py --peer` (Llama h256, ffn 1024, 4 layers, GQA 4/2, vocab 512,
sequence 128, fp32, 32 sequences per step) trains in fresh torchrun groups: 1x1x1 on every core
of the machine and on one thread, and 2x2x2 (REDUCE_SCATTER, 8 gloo ranks of one thread each).
Every rank builds the run `mesh3d train` builds (`Run.prepare`) and steps it as the training loop does
(`run.step`, then the loop's stop check). The functions one step calls (reading the batch,
preparing it, forward+backward with the pipeline schedule, the dp gradient sum, the
tied-embedding sync, the Partial-gradient reduction, the norm and clipping, the optimizer, the
stop check) are wrapped in timers that add up the wall seconds and the CPU seconds of the process
(`time.process_time`: every thread of the rank, gloo's included) spent inside each. Inside
forward+backward, `overhead.py` splits rank 0's time by operator (kernels, DTensor, collectives).

Reported per layout: CPU seconds per step summed over ranks, per phase and in all, and wall
seconds per step (the slowest rank); the 2x2x2 / 1x1x1 ratio of each. The first `SKIP` steps
are left out. With fewer cores than ranks the 2x2x2 ranks take turns on the cores, so its summed
CPU seconds are the work the layout adds, and the wall time is what a step costs on this
machine. Raw numbers: `benchmarks/results/local/step_breakdown[_tiny].json` (`--publish`:
`benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _results import add_publish_flag, print_header, results_dir
from _ways import COMMON, CONFIG, ROOT, SHAPES, shape_overrides

# the peer shape of throughput.py --peer (`_ways.SHAPES`), and its toy version for the test
SHAPE = {"peer": "peer", "tiny": "peer_tiny"}
STEPS = {"peer": 12, "tiny": 4}
SKIP = 2  # steps left out: the first builds caches, the second may still warm up
# name -> (dp, tp, pp), intra-op threads per rank: the one process a user runs (every core), the
# same on one thread (the work without OpenMP's), and the 3D layout
LAYOUTS = {
    "1x1x1": ((1, 1, 1), os.cpu_count() or 1),
    "1x1x1 1 thread": ((1, 1, 1), 1),
    "2x2x2": ((2, 2, 2), 1),
    # one axis at a time, one rank per core (no oversubscription): what each axis adds alone
    "dp2": ((2, 1, 1), 1),
    "tp2": ((1, 2, 1), 1),
    "pp2": ((1, 1, 2), 1),
}
DEFAULT_LAYOUTS = ("1x1x1", "1x1x1 1 thread", "2x2x2")
PHASES = ("read batch", "prepare batch", "forward+backward", "dp grad sum", "tied-embedding sync",
          "partial-grad reduce", "norm + clip", "optimizer", "stop check")  # fmt: skip


def overrides(shape: str, dims: tuple[int, int, int], steps: int, tp_mode: str) -> list[str]:
    dp, tp, pp = dims
    acc = SHAPES[SHAPE[shape]][-1]
    return [
        *COMMON,
        *shape_overrides(SHAPE[shape]),
        f"tokens.train_steps={steps}",
        f"tokens.batch_accumulation_per_replica={acc // dp}",
        f"parallelism.dp={dp}",
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.tp_mode={tp_mode}",
    ]


class Timers:
    """Wall and process-CPU seconds spent inside wrapped functions, per phase and step."""

    def __init__(self):
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        self.depth = 0

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.depth:  # nested inside a timed phase: counted there
                return inner(*args, **kwargs)
            self.depth += 1
            w, c = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - w
                self.cpu[phase] += time.process_time() - c
                self.depth -= 1

        setattr(owner, name, timed)

    def take(self) -> dict:
        out = dict(wall={p: self.wall[p] for p in PHASES}, cpu={p: self.cpu[p] for p in PHASES})
        self.wall.clear()
        self.cpu.clear()
        return out


def rank_main(shape: str, tp_mode: str, dims: tuple[int, int, int], steps: int, out: str) -> None:
    """One torchrun rank: build the run, step it with the timers."""
    import torch.distributed as dist

    import mesh3d.parallel.pipeline as pipeline_mod
    import mesh3d.parallel.tensor as tensor_mod
    import mesh3d.train.step as step_mod
    from mesh3d.config import load_config
    from mesh3d.mesh import shutdown_distributed
    from mesh3d.train.guard import RunGuard
    from mesh3d.train.run import Run

    cfg = load_config(CONFIG, overrides(shape, dims, steps, tp_mode))
    run = Run.prepare(cfg)
    timers = Timers()
    timers.wrap(Run, "batches", "read batch")
    # step.py imports the pp and tp helpers where it calls them (a one-process run loads
    # neither module), so those two are wrapped in their own modules
    for owner, name, phase in ((step_mod, "prepare_batches", "prepare batch"),
                               (step_mod, "forward_backward", "forward+backward"),
                               (step_mod, "allreduce_gradients", "dp grad sum"),
                               (pipeline_mod, "sync_tied_embeddings", "tied-embedding sync"),
                               (tensor_mod, "reduce_partial_grads", "partial-grad reduce"),
                               (step_mod, "clip_grad_norm", "norm + clip")):  # fmt: skip
        timers.wrap(owner, name, phase)
    for reducer in run.parts.reducers:  # zero_stage 0 buckets: what the backward left, then wait
        timers.wrap(reducer, "finish", "dp grad sum")
    timers.wrap(run.optimizer, "step", "optimizer")
    guard = RunGuard.__new__(RunGuard)  # only its stop check: one all-reduce of one integer
    guard.signals, guard.world, guard.device = (
        type("S", (), {"received": None})(),
        dist.get_world_size(),
        run.device,
    )
    timers.wrap(guard, "stop_requested", "stop check")
    records = []
    for k in range(1, steps + 1):
        w, c = time.perf_counter(), time.process_time()
        run.step(k)
        guard.stop_requested()
        rec = timers.take()
        rec["step_wall"], rec["step_cpu"] = time.perf_counter() - w, time.process_time() - c
        records.append(rec)
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(records))
    # mesh3d's own teardown: its cached groups go first (a bare destroy_process_group left
    # them to interpreter exit, which aborted 1 run in 5 at tp2, `terminate called ...`)
    shutdown_distributed()


def run_layout(shape: str, name: str, tp_mode: str) -> dict:
    """A fresh torchrun group for layout `name`: per step, CPU summed over ranks and the
    slowest rank's wall, per phase and in all."""
    dims, threads = LAYOUTS[name]
    ranks, steps = dims[0] * dims[1] * dims[2], STEPS[shape]
    with tempfile.TemporaryDirectory(prefix="mesh3d-breakdown-") as tmp:
        out = str(Path(tmp) / "rank")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, "--rank-worker", shape, tp_mode,
               ",".join(map(str, dims)), str(steps), out]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    timed = range(SKIP, steps)
    cpu = {p: statistics.median(sum(rk[k]["cpu"][p] for rk in per_rank) for k in timed)
           for p in PHASES}  # fmt: skip
    wall = {p: statistics.median(max(rk[k]["wall"][p] for rk in per_rank) for k in timed)
            for p in PHASES}  # fmt: skip
    step_cpu = statistics.median(sum(rk[k]["step_cpu"] for rk in per_rank) for k in timed)
    step_wall = statistics.median(max(rk[k]["step_wall"] for rk in per_rank) for k in timed)
    return dict(ranks=ranks, threads=threads, cpu=cpu, wall=wall, step_cpu=step_cpu,
                step_wall=step_wall)  # fmt: skip


def table(result: dict) -> str:
    """Markdown: per phase, each layout's CPU seconds and 2x2x2's over the one-thread 1x1x1's;
    then each layout's wall seconds per step and the efficiency 1x1x1 wall / 2x2x2 wall."""
    lay = result["layouts"]
    names, three, one_thread = list(lay), lay["2x2x2"], lay["1x1x1 1 thread"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b > 1e-6 else "—"

    def row(label: str, values: dict[str, float]) -> str:
        cells = " | ".join(f"{values[n]:.4f}" for n in names)
        return f"| {label} | {cells} | {ratio(values['2x2x2'], values['1x1x1 1 thread'])} |"

    lines = [f"CPU seconds per step summed over ranks (median of steps {SKIP + 1}-"
             f"{result['steps']}); ratio: 2×2×2 over the one-thread 1×1×1", "",
             f"| phase | {' | '.join(names)} | ratio |", "|---" * (len(names) + 2) + "|"]  # fmt: skip
    for p in PHASES:
        lines.append(row(p, {n: lay[n]["cpu"][p] for n in names}))
    lines.append(
        row("the rest", {n: lay[n]["step_cpu"] - sum(lay[n]["cpu"].values()) for n in names})
    )
    lines.append(row("**step**", {n: lay[n]["step_cpu"] for n in names}))
    walls = ", ".join(f"{n} {lay[n]['step_wall']:.3f} s" for n in names)
    lines += ["", f"wall seconds per step (slowest rank): {walls}",
              f"efficiency (1×1×1 wall / 2×2×2 wall): {lay['1x1x1']['step_wall'] / three['step_wall']:.3f}; "
              f"over the one-thread 1×1×1: {one_thread['step_wall'] / three['step_wall']:.3f}"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank-worker":
        shape, tp_mode, dims, steps, out = argv[1:]
        return rank_main(shape, tp_mode, tuple(int(x) for x in dims.split(",")), int(steps), out)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes (the test)")
    ap.add_argument("--tp-mode", default="REDUCE_SCATTER", choices=["REDUCE_SCATTER", "ALL_REDUCE"],
                    help="parallelism.tp_mode of the 2x2x2 run (default REDUCE_SCATTER)")  # fmt: skip
    ap.add_argument("--axes", action="store_true",
                    help="also dp2, tp2 and pp2 alone (2 ranks each, one per core): what each "
                         "axis adds without ranks taking turns on the cores")  # fmt: skip
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    head = print_header()
    shape = "tiny" if args.tiny else "peer"
    layouts = {}
    for name in LAYOUTS if args.axes else DEFAULT_LAYOUTS:
        t0 = time.time()
        layouts[name] = run_layout(shape, name, args.tp_mode)
        print(f"{name}: {layouts[name]['step_wall']:.3f} s per step (wall), "
              f"{layouts[name]['step_cpu']:.3f} CPU s summed over ranks ({time.time() - t0:.0f} s)",
              flush=True)  # fmt: skip
    result = dict(head, shape=shape, tp_mode=args.tp_mode, shape_values=SHAPES[SHAPE[shape]], steps=STEPS[shape],
                  skipped_steps=SKIP, layouts=layouts)  # fmt: skip
    print(table(result))
    mode = ("" if args.tp_mode == "REDUCE_SCATTER" else "_all_reduce") + (
        "_axes" if args.axes else ""
    )
    path = results_dir(args.publish) / f"step_breakdown{mode}{'_tiny' if args.tiny else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
