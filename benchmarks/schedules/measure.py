"""Measured mode: a real mesh3d pipeline on each rank, its summary in the parent, the layer probe.

`measure_rank` runs on each of `pp` real processes (forked on CPU with gloo and one intra-op
thread each; spawned on CUDA with nccl when there are >= pp GPUs; `_ranks.launch` starts them) a
real mesh3d pipeline of a small Llama, built with `build_stage` -> `parallelize` ->
`pipeline_stage` -> `build_schedule` and stepped with `run_schedule`; `record.py` times its
actions and meters the bytes saved for backward. `summarize_measured` turns what the ranks
recorded into one job's numbers. `probe_layer` times one decoder layer in this process: the
simulator's costs (F, full B, and I / W through torch's own `stage_backward_input` /
`stage_backward_weight`).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mesh3d.config import load_config, padded_vocab_size
from mesh3d.layout import RunLayout
from mesh3d.mesh import ParallelDims, build_mesh
from mesh3d.models.llama import Llama
from mesh3d.parallel.parallelize import parallelize
from mesh3d.parallel.pipeline import (
    build_schedule,
    build_stage,
    pipeline_stage,
    run_schedule,
    split_layers,
    stage_ids_of_rank,
)
from mesh3d.plan import _peaks, bubble, loss_saved_bytes, stage_activation_bytes
from mesh3d.train.build import initial_weights
from mesh3d.train.loss import normalized_loss
from schedules.record import Recorder, SavedBytes  # benchmarks/ is on sys.path (see __main__)
from schedules.sim import Timeline, action_table, simulate, virtual_stages

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes/configs/cpu_tiny.yaml"  # every run's base config; the ranks load it too


def stage_layers(cfg, stages: int) -> list[list[int]]:
    """The decoder layers of each stage: mesh3d's `split_layers` (Nanotron's cost walk).

    The walk keeps the block that crosses a stage's cost threshold on that stage, so stage 0
    always gets more than 1/stages of the cost; with a head cheaper than a layer in that cost
    model (V < 4h + 3F, here 5376 < 6176) 7 layers still split as [[0-3], [4-6] + head] over 2
    stages and [[0, 1], [2, 3], [4, 5], [6] + head] over 4, and the real head costs about a
    layer: equal stages, so the measured bubble shows the schedule, not an imbalance.
    """
    mc = cfg.model.model_config
    h, heads = mc.hidden_size, mc.num_attention_heads
    return split_layers(mc.num_hidden_layers, stages, h, mc.intermediate_size, heads, h // heads,
                        padded_vocab_size(cfg))  # fmt: skip


# --- measured mode: ranks ------------------------------------------------------------------------


def _build(cfg, mesh, device: torch.device, schedule: str, recorder: Recorder):
    """This rank's stages and schedule, as `mesh3d.train.build` makes them, with a timed loss."""
    mc, tok, pp = cfg.model.model_config, cfg.tokens, cfg.parallelism.pp
    v, m = virtual_stages(schedule), tok.batch_accumulation_per_replica
    n, vocab = pp * v, padded_vocab_size(cfg)
    layers = stage_layers(cfg, n)
    with torch.device("meta"):
        full = Llama(mc, vocab_size=vocab, attention=cfg.mesh3d.attention)
    source, mode = initial_weights(cfg, RunLayout.of(cfg)), "replicate"
    ids = stage_ids_of_rank(mesh["pp"].get_local_rank(), pp, v, schedule)
    modules = [
        parallelize(build_stage(full, i, n, layers[i]), mesh, device=device, source=source,
                    tp_plan={}, recompute_layer=False, dp=mode)
        for i in ids
    ]  # fmt: skip
    stages = [
        pipeline_stage(mod, i, n, device, mesh["pp"].get_group(), microbatch_size=tok.micro_batch_size,
                       seq_len=tok.sequence_length, seq_len_local=tok.sequence_length,
                       hidden_size=mc.hidden_size, vocab_size=vocab, dtype=torch.float32)
        for mod, i in zip(modules, ids)
    ]  # fmt: skip
    tokens = m * tok.micro_batch_size * tok.sequence_length

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return normalized_loss(logits, labels, mc.vocab_size, tokens)

    for stage in stages:
        recorder.wrap_stage(stage)
    sched = build_schedule(schedule, stages, m, recorder.wrap_loss(loss_fn, n - 1))
    return modules, stages, sched


def measure_rank(rank: int, world: int, jobs: list[dict], reps: int) -> list[dict]:
    """On one rank: every job (schedule, m) for 1 warm-up step (metered) and `reps` timed steps."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = build_mesh(ParallelDims(dp=1, tp=1, pp=world), device.type)
    out = []
    for job in jobs:
        t_job = time.time()
        cfg = load_config(str(CONFIG), job["overrides"])
        tok = cfg.tokens
        recorder = Recorder(sync=device.type == "cuda")
        modules, stages, sched = _build(cfg, mesh, device, job["schedule"], recorder)
        shape = (tok.batch_accumulation_per_replica * tok.micro_batch_size, tok.sequence_length)
        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, cfg.model.model_config.vocab_size, shape, generator=gen)
        labels = torch.randint(0, cfg.model.model_config.vocab_size, shape, generator=gen)
        ids, labels = ids.to(device), labels.to(device)
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        params = [p for mod in modules for p in mod.parameters()]
        steps, meter = [], SavedBytes(params)
        for step in range(reps + 1):
            for p in params:
                p.grad = None
            dist.barrier()
            recorder.events, recorder.meter = [], meter if step == 0 else None
            hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)
            with hooks if step == 0 else contextlib.nullcontext():
                t0 = recorder.now()
                run_schedule(sched, stages, ids if first else None, labels if last else None)
                t1 = recorder.now()
            if step:
                steps.append(dict(wall=(t0, t1), events=recorder.events))
        dist.barrier()
        out.append(dict(steps=steps, saved_peak=meter.total_peak, saved_peak_by_stage=meter.peak))
        if rank == 0:
            print(f"  measured {job['schedule']} m={job['m']}: {time.time() - t_job:.1f}s",
                  file=sys.stderr, flush=True)  # fmt: skip
        del modules, stages, sched
    return out


# --- measured mode: the parent's view ------------------------------------------------------------


def _plan_peaks(cfg, schedule: str, pp: int, m: int, layers: list[list[int]]) -> list[int]:
    """mesh3d.plan's saved-for-backward peak per rank for this table and split."""
    v, n = virtual_stages(schedule), len(layers)
    sizes = {i: stage_activation_bytes(cfg, len(layers[i]), i == 0, i == n - 1) for i in range(n)}
    saved, held = {i: b[0] for i, b in sizes.items()}, {i: b[1] for i, b in sizes.items()}
    table = action_table(schedule, pp, v, m)
    loss = {n - 1: loss_saved_bytes(cfg)}  # freed at I by a split backward
    return [_peaks([(k, s) for k, s, _ in table[r]], saved, held, loss)[0] for r in range(pp)]


def summarize_measured(job: dict, ranks: list[dict], pp: int) -> dict:
    """One job's numbers over its timed steps.

    step_s: the median wall time (first rank's start to last rank's end of `run_schedule`);
    bubble and timeline: the step with the median bubble (over its action window); bubble_sim:
    the table replayed with the median measured duration of each (kind, stage); memory: the
    metered peak per rank against `mesh3d.plan`'s estimate for the same order and split.
    """
    schedule, m, cfg = job["schedule"], job["m"], job["cfg"]
    v = virtual_stages(schedule)
    reps = len(ranks[0]["steps"])
    timelines, walls = [], []
    for i in range(reps):
        timelines.append(Timeline({r: ranks[r]["steps"][i]["events"] for r in range(pp)}))
        walls.append(max(rk["steps"][i]["wall"][1] for rk in ranks)
                     - min(rk["steps"][i]["wall"][0] for rk in ranks))  # fmt: skip
    order = sorted(range(reps), key=lambda i: timelines[i].bubble)
    median = order[len(order) // 2]
    durations: dict[tuple[str, int], list[float]] = {}
    for tl in timelines:
        for evs in tl.events.values():
            for k, s, _, a, b in evs:
                durations.setdefault((k, s), []).append(b - a)
    cost = {key: statistics.median(d) for key, d in durations.items()}
    table = action_table(schedule, pp, v, m)
    ran = {r: [(k, s, mb) for k, s, mb, *_ in timelines[0].events[r]] for r in range(pp)}
    sim = simulate(table, lambda k, s: cost[k, s])
    # each timed step's own action durations replayed with free, instant communication: what
    # is left between it and the measured bubble is send/recv and the time between actions
    replays = [
        simulate(table, None, durations={(k, s, mb): b - a for evs in tl.events.values()
                                         for k, s, mb, a, b in evs}).bubble
        for tl in timelines
    ]  # fmt: skip
    analytic = bubble(schedule, pp, v, m)
    tok = cfg.tokens
    tokens = m * tok.micro_batch_size * tok.sequence_length
    layers = stage_layers(cfg, pp * v)
    wall = statistics.median(walls)
    by_stage = {s: b for rk in ranks for s, b in rk["saved_peak_by_stage"].items()}

    def by_stage_kind(item):
        (kind, stage), _ = item
        return stage, kind

    return dict(
        schedule=schedule, pp=pp, v=v, m=m, reps=reps, split=layers,
        order_matches_table=ran == table,
        step_s=wall, step_s_all=walls, window_s=timelines[median].step,
        tokens_per_s=tokens / wall,
        bubble=timelines[median].bubble, bubble_all=[tl.bubble for tl in timelines],
        bubble_replay=replays[median], bubble_replay_all=replays,
        bubble_sim=sim.bubble, step_sim_s=sim.step,
        bubble_analytic=analytic.fraction, analytic_kind=analytic.kind, analytic_formula=analytic.formula,
        action_ms={f"{k}{s}": round(c * 1e3, 3) for (k, s), c in sorted(cost.items(), key=by_stage_kind)},
        saved_peak_bytes=[rk["saved_peak"] for rk in ranks],
        saved_peak_bytes_by_stage={str(s): b for s, b in sorted(by_stage.items()) if s >= 0},
        saved_plan_bytes=_plan_peaks(cfg, schedule, pp, m, layers),
        timeline_ms=timelines[median].shifted(1e3),
    )  # fmt: skip


# --- simulated mode: the layer probe -------------------------------------------------------------


def probe_layer(overrides: list[str], device: torch.device, reps: int) -> dict[str, float]:
    """Median seconds of F, B, I and W of one decoder layer at the config's shapes.

    F: the layer's forward; B: a full backward from a random output gradient; I and W: the same
    backward split by torch's `stage_backward_input` / `stage_backward_weight` (what zero-bubble
    schedules run). Falls back to I = W = B / 2 if those private helpers are missing.
    """
    one = load_config(str(CONFIG), [*overrides, "model.model_config.num_hidden_layers=1"])
    mc, tok = one.model.model_config, one.tokens
    torch.manual_seed(0)
    model = Llama(mc, vocab_size=padded_vocab_size(one), attention=one.mesh3d.attention)
    layer = build_stage(model, 1, 3, [0]).to(device)  # a middle stage: one layer, no embedding/head
    x = torch.randn(tok.micro_batch_size, tok.sequence_length, mc.hidden_size, device=device)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        from torch.distributed.pipelining import _backward

        stage_backward_input = _backward.stage_backward_input
        stage_backward_weight = _backward.stage_backward_weight
    except (ImportError, AttributeError):  # torch moved its private helpers
        stage_backward_input = stage_backward_weight = None
    times: dict[str, list[float]] = {k: [] for k in "FBIW"}
    params = list(layer.parameters())
    for _ in range(reps + 1):  # the first round warms up
        sync()
        t0 = time.perf_counter()
        y = layer(x)
        sync()
        t1 = time.perf_counter()
        y.backward(grad)
        sync()
        times["F"].append(t1 - t0)
        times["B"].append(time.perf_counter() - t1)
        if stage_backward_input is not None:
            y = layer(x)
            sync()
            t0 = time.perf_counter()
            _, groups = stage_backward_input([y], [grad], [x], iter(params))
            sync()
            t1 = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            sync()
            times["I"].append(t1 - t0)
            times["W"].append(time.perf_counter() - t1)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    cost = {k: statistics.median(v[1:]) for k, v in times.items() if v}
    if "I" not in cost:
        cost["I"] = cost["W"] = cost["B"] / 2
    return cost
