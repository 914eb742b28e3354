"""Pipeline schedules compared: step timelines, bubbles, activation memory and throughput.

    python benchmarks/schedules          # quick: measured pp=2 (m = 2, 4, 8) + simulated grid
    python benchmarks/schedules --full   # the same with more repetitions
    python benchmarks/schedules --tiny   # a tiny model, seconds (the test runs this)

(`python -m benchmarks.schedules` from the repository root does the same.)

Every schedule mesh3d offers (`mesh3d.parallel.pipeline.SCHEDULES`), two ways:

- measured (`measure.py`, `record.py`): `pp` real processes (forked on CPU with gloo and
  one intra-op thread each; spawned on CUDA with nccl when there are >= pp GPUs) run a real mesh3d
  pipeline of a small Llama. Every compute action (F, B, or I and W) is timestamped on the
  system-wide monotonic clock, so ranks share one time axis; sends, receives and their waits count
  as idle. Bytes saved for backward are metered per stage and per rank on the warm-up step.
- simulated (`sim.py`): each rank's compute actions in torch's own order are replayed with
  per-action costs: those of one decoder layer measured on this machine (F, full B, and I / W
  through torch's own `stage_backward_input` / `stage_backward_weight`), times the layers of a
  stage; the simulated model has SIM_LAYERS layers split evenly over the pp x v stages. With unit
  costs (F = I = W = 1, B = 2) the simulated bubbles equal `mesh3d.plan.bubble`'s closed forms.
  Activation peaks are `mesh3d.plan.stage_activation_bytes` per microbatch replayed over the same
  order (`mesh3d.plan._peaks`).

Bubble = idle / (ranks x step), the step spanning the first action's start to the last one's end.
Writes benchmarks/results/local/schedules.{json,md,png} (schedules_tiny.* for --tiny; --publish
writes them to the tracked benchmarks/results/, --out DIR anywhere; `report.py` renders them);
the PNG has one panel per schedule: simulated (pp=4, m=8) on the left, measured pp=2 on the right,
a row per rank, actions colored by kind.

This file (the package's `__main__`) holds the models, the modes, the configs of each run, the
simulated grid and `main`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed.pipelining  # noqa: F401  (imported before forking: ranks find it loaded)

# benchmarks/ on the path: its shared helpers, and this package by name
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _ranks import keep_freed_memory, launch  # noqa: E402
from _results import add_publish_flag, results_dir  # noqa: E402

from mesh3d.checks import validation_errors
from mesh3d.config import load_config
from mesh3d.parallel.pipeline import SCHEDULES
from mesh3d.plan import _peaks, bubble, stage_activation_bytes
from schedules.measure import CONFIG, measure_rank, probe_layer, summarize_measured  # noqa: E402
from schedules.report import chart, compact_json, tables  # noqa: E402
from schedules.sim import UNIT, action_table, simulate, virtual_stages  # noqa: E402

# A small Llama whose stages cost about the same: 7 decoder layers and a head (norm, lm_head over
# 5376 tokens, loss) whose forward + backward take about one layer's time here (measured: with
# 6144 tokens stage 1 was ~8% slower than stage 0, with 4608 ~8% faster); mesh3d's split
# (`measure.stage_layers`) gives each of 2 stages 4 of these 8 units and each of 4
# stages 2.
MODEL = {
    "model.model_config.hidden_size": 512, "model.model_config.intermediate_size": 1376,
    "model.model_config.num_attention_heads": 8, "model.model_config.num_key_value_heads": 4,
    "model.model_config.num_hidden_layers": 7, "model.model_config.vocab_size": 5376,
    "model.model_config.max_position_embeddings": 128, "model.model_config.tie_word_embeddings": False,
    "tokens.sequence_length": 128, "tokens.micro_batch_size": 1, "model.dtype": "float32",
    "logging.log_level": "warning",
}  # fmt: skip
TINY_MODEL = MODEL | {
    "model.model_config.hidden_size": 64, "model.model_config.intermediate_size": 172,
    "model.model_config.vocab_size": 512, "model.model_config.max_position_embeddings": 32,
    "tokens.sequence_length": 32,
}  # fmt: skip
SIM_LAYERS = 16  # the simulated model: 16 decoder layers at the measured shapes
SIM_PP = (2, 4, 8)
CHART_SIM = (4, 8)  # (pp, m) of the simulated panels
CHART_MEASURED_M = 4  # m of the measured pp=2 panels
MODES = {  # reps: timed steps per measured run; probe: repetitions of the layer probe
    "tiny": dict(reps=2, probe=2, measured_m=(4,), sim_pp=(2, 4), timeout=240),
    "quick": dict(reps=5, probe=7, measured_m=(2, 4, 8), sim_pp=SIM_PP, timeout=1200),
    "full": dict(reps=10, probe=25, measured_m=(2, 4, 8), sim_pp=SIM_PP, timeout=3600),
}


# --- configs ------------------------------------------------------------------------------------


def overrides_of(model: dict, schedule: str, pp: int, m: int, layers: int | None = None) -> list:
    """Config overrides for `schedule` at (pp, m) on `model` (optionally another layer count)."""
    values = model | {
        "parallelism.pp": pp, "parallelism.dp": 1, "parallelism.tp": 1,
        "mesh3d.pp_schedule": schedule, "mesh3d.pp_virtual_stages": virtual_stages(schedule),
        "tokens.batch_accumulation_per_replica": m, "mesh3d.device": "cpu",
    }  # fmt: skip
    if layers is not None:
        values["model.model_config.num_hidden_layers"] = layers
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def why_not(overrides: list[str], pp: int) -> str | None:
    """mesh3d's reason to refuse this layout (its config validation), or None."""
    errors = validation_errors(load_config(str(CONFIG), overrides), world_size=pp)
    return "; ".join(errors) or None


# --- simulated mode ------------------------------------------------------------------------------


def simulate_grid(
    model: dict, layer_cost: dict[str, float], sim_pp: tuple, log
) -> tuple[list, list]:
    """Every (schedule, pp, m) of the grid: simulated rows, and skipped ones with mesh3d's reason."""
    rows, skipped = [], []
    for schedule in SCHEDULES:
        v = virtual_stages(schedule)
        for pp in sim_pp:
            for m in (pp, 2 * pp, 4 * pp):
                overrides = overrides_of(model, schedule, pp, m, layers=SIM_LAYERS)
                reason = why_not(overrides, pp)
                if reason:
                    skipped.append(
                        dict(schedule=schedule, pp=pp, m=m, mode="simulated", reason=reason)
                    )
                    continue
                cfg = load_config(str(CONFIG), overrides)
                per = SIM_LAYERS // (pp * v)
                table = action_table(schedule, pp, v, m)
                tl = simulate(table, lambda k, s, per=per: per * layer_cost[k])
                unit = simulate(table, lambda k, s: UNIT[k])
                saved, held = stage_activation_bytes(cfg, per, False, False)
                peaks = [_peaks([(k, s) for k, s, _ in table[r]], {s: saved for s in range(pp * v)},
                                {s: held for s in range(pp * v)}) for r in range(pp)]  # fmt: skip
                analytic = bubble(schedule, pp, v, m)
                tok = cfg.tokens
                rows.append(dict(
                    schedule=schedule, pp=pp, v=v, m=m, layers_per_stage=per,
                    step_s=tl.step, tokens_per_s=m * tok.micro_batch_size * tok.sequence_length / tl.step,
                    bubble=tl.bubble, bubble_unit=unit.bubble, bubble_analytic=analytic.fraction,
                    analytic_kind=analytic.kind, analytic_formula=analytic.formula,
                    saved_per_microbatch_bytes=saved, saved_peak_bytes=[p[0] for p in peaks],
                    in_flight=[p[2] for p in peaks], timeline_ms=tl.shifted(1e3),
                ))  # fmt: skip
        log(f"  simulated {schedule}")
    return rows, skipped


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--tiny", action="store_true", help="a tiny model, seconds (for the test)")
    group.add_argument("--full", action="store_true", help="more repetitions")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/local)")
    add_publish_flag(ap)
    ap.add_argument("--measured-pp", type=int, default=2, help="ranks of the measured runs")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset")
    ap.add_argument("--glibc-malloc", action="store_true",
                    help="leave glibc's malloc as it is (by default the ranks keep freed memory)")  # fmt: skip
    a = ap.parse_args(argv)
    mode = "tiny" if a.tiny else "full" if a.full else "quick"
    opts, model = MODES[mode], TINY_MODEL if a.tiny else MODEL
    names = a.schedules.split(",")
    unknown = set(names) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    out_dir = a.out or results_dir(a.publish)
    stem = "schedules_tiny" if a.tiny and a.out is None else "schedules"
    t_all = time.time()
    pp = a.measured_pp
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= pp
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cores = os.cpu_count() or 1
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"torch {torch.__version__} | cores {cores} | {now} | load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    device = "cuda" if cuda else "cpu"
    print(f"mode {mode}; model: " + " ".join(f"{k.split('.')[-1]}={v}" for k, v in model.items()
                                             if k.startswith(("model.model_config", "tokens"))))  # fmt: skip
    if cuda:
        print(f"measured: {pp} ranks on {pp} GPUs (nccl, spawned)")
    else:
        if torch.cuda.is_available():
            print(f"measured: {torch.cuda.device_count()} GPU(s) < pp={pp}: the ranks run on CPU")
        print(f"measured: {pp} forked ranks x 1 intra-op thread on {cores} cores (gloo); "
              f"pp > {cores} would oversubscribe the cores, so larger pp is simulated only")  # fmt: skip
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    # measured runs first: on CUDA the parent must not touch the GPU before its ranks start
    jobs, skipped = [], []
    for name in names:
        for m in opts["measured_m"]:
            m_pp = m * pp // 2  # m counts are given for pp=2: pp, 2pp, 4pp
            overrides = overrides_of(model, name, pp, m_pp)
            reason = why_not(overrides, pp)
            if reason:
                skipped.append(dict(schedule=name, pp=pp, m=m_pp, mode="measured", reason=reason))
            else:
                jobs.append(dict(schedule=name, m=m_pp, overrides=overrides))
    log(f"measured: {len(jobs)} runs x ({opts['reps']} timed + 1 warm-up) steps")
    t0 = time.time()
    setup = None if a.glibc_malloc or cuda else keep_freed_memory
    ranks = launch(pp, measure_rank, jobs, opts["reps"], cuda=cuda, timeout=opts["timeout"],
                   setup=setup)  # fmt: skip
    measured_s = time.time() - t0
    measured = []
    for i, job in enumerate(jobs):
        job["cfg"] = load_config(str(CONFIG), job["overrides"])
        measured.append(summarize_measured(job, [rk[i] for rk in ranks], pp))

    torch.set_num_threads(1)  # the probe runs like one rank
    probe_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = probe_layer(overrides_of(model, "1f1b", 2, 2), probe_device, opts["probe"])
    log("probe: one layer " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in layer.items()))
    sim_rows, sim_skipped = simulate_grid(model, layer, opts["sim_pp"], log)
    sim_rows = [r for r in sim_rows if r["schedule"] in names]
    skipped += [s for s in sim_skipped if s["schedule"] in names]

    result = dict(
        command=sys.argv, torch=torch.__version__, cores=cores, date=now, mode=mode,
        load_average=os.getloadavg(), model=model, measured_pp=pp, measured_device=device,
        measured_threads_per_rank=1, measured_seconds=measured_s,
        measured_malloc="glibc default" if setup is None else "keep freed memory",
        probe=dict(device=probe_device.type, reps=opts["probe"], layer_ms={k: v * 1e3 for k, v in layer.items()}),
        simulated_layers=SIM_LAYERS, unit_costs=UNIT,
        chart=dict(simulated=list(CHART_SIM), measured_m=CHART_MEASURED_M * pp // 2),
        measured=measured, simulated=sim_rows, skipped=skipped,
    )  # fmt: skip
    report = tables(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{stem}.png"
    drew = chart(result, png)
    result["runtime_s"] = time.time() - t_all
    result["load_average_end"] = os.getloadavg()
    (out_dir / f"{stem}.json").write_text(compact_json(result))
    (out_dir / f"{stem}.md").write_text(report)
    print("\n" + report)
    written = [f"{stem}.json", f"{stem}.md"] + ([png.name] if drew else [])
    shown = [os.path.relpath(out_dir / w) for w in written]
    load = " ".join(f"{x:.1f}" for x in result["load_average_end"])
    print(f"total {result['runtime_s']:.1f}s (measured {measured_s:.1f}s); load average at the "
          f"end {load}; wrote {', '.join(shown)}")  # fmt: skip


if __name__ == "__main__":
    main()
