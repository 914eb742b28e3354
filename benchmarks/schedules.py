"""Pipeline schedules compared: step timelines, bubbles, activation memory and throughput.

    python benchmarks/schedules.py          # quick: measured pp=2 (m = 2, 4, 8) + simulated grid
    python benchmarks/schedules.py --full   # the same with more repetitions
    python benchmarks/schedules.py --tiny   # a tiny model, seconds (the test runs this)

Every schedule mesh3d offers (`mesh3d.parallel.pipeline.SCHEDULES`), two ways:

- measured: `pp` real processes (forked on CPU with gloo and one intra-op thread each; spawned on
  CUDA with nccl when there are >= pp GPUs) run a real mesh3d pipeline of a small Llama, built with
  `build_stage` -> `parallelize` -> `pipeline_stage` -> `build_schedule` and stepped with
  `run_schedule`. Each action is timestamped by wrapping the `PipelineStage` methods every torch
  schedule calls for compute (`forward_one_chunk`: F, `backward_one_chunk`: B, or I when called
  with `full_backward=False`, `backward_weight_one_chunk`: W), with `time.perf_counter` (the
  system-wide monotonic clock, so ranks share one time axis; CUDA is synchronized at both ends).
  The last stage's loss runs inside its F (the loss function is wrapped too). Receives, sends and
  their waits run between these calls, so they count as idle. Bytes saved for backward are
  metered with `torch.autograd.graph.saved_tensors_hooks` (parameters left out), per stage and
  per rank, on the warm-up step.
- simulated: each rank's compute actions in torch's own order (`pipeline_order` of the schedule
  class, built from stand-in stages; GPipe / 1F1B as their step loops run) are replayed with
  per-action costs: F(s, k) starts after F(s-1, k); B or I(s, k) after F(s, k) and the input
  gradient of (s+1, k); W(s, k) after I(s, k); each rank runs its list in order. The costs are
  those of one decoder layer measured on this machine (F, full B, and I / W through torch's own
  `stage_backward_input` / `stage_backward_weight`), times the layers of a stage; the simulated
  model has SIM_LAYERS layers split evenly over the pp x v stages. With unit costs (F = I = W = 1,
  B = 2) the simulated bubbles equal `mesh3d.plan.bubble`'s closed forms. Activation peaks are
  `mesh3d.plan.stage_activation_bytes` per microbatch replayed over the same order
  (`mesh3d.plan._peaks`).

Bubble = idle / (ranks x step), the step spanning the first action's start to the last one's end.
Writes benchmarks/results/schedules.{json,md,png} (schedules_tiny.* for --tiny; --out DIR moves
them); the PNG has one panel per schedule: simulated (pp=4, m=8) on the left, measured pp=2 on
the right, a row per rank, actions colored by kind.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import re
import shlex
import statistics
import sys
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401  (imported before forking: ranks find it loaded)
from _ranks import keep_freed_memory, launch  # benchmarks/ is on sys.path when a script runs
from torch import nn

from mesh3d.config import load_config, padded_vocab_size, validation_errors
from mesh3d.mesh import ParallelDims, build_mesh
from mesh3d.models.llama import Llama
from mesh3d.parallel.parallelize import dp_mode, parallelize
from mesh3d.parallel.pipeline import (
    SCHEDULES,
    build_schedule,
    build_stage,
    is_multi_stage,
    pipeline_stage,
    run_schedule,
    split_layers,
    stage_ids_of_rank,
)
from mesh3d.plan import _orders, _peaks, bubble, loss_saved_bytes, stage_activation_bytes
from mesh3d.train.build import initial_weights
from mesh3d.train.loss import normalized_loss

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes/configs/cpu_tiny.yaml"
MiB = 2**20

# A small Llama whose stages cost about the same: 7 decoder layers and a head (norm, lm_head over
# 5376 tokens, loss) whose forward + backward take about one layer's time here (measured: with
# 6144 tokens stage 1 was ~8% slower than stage 0, with 4608 ~8% faster); mesh3d's split
# (`stage_layers`) gives each of 2 stages 4 of these 8 units and each of 4 stages 2.
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
UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # unit costs: F = I = W, B = I + W
KIND_NAMES = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
MODES = {  # reps: timed steps per measured run; probe: repetitions of the layer probe
    "tiny": dict(reps=2, probe=2, measured_m=(4,), sim_pp=(2, 4), timeout=240),
    "quick": dict(reps=5, probe=7, measured_m=(2, 4, 8), sim_pp=SIM_PP, timeout=1200),
    "full": dict(reps=10, probe=25, measured_m=(2, 4, 8), sim_pp=SIM_PP, timeout=3600),
}

Action = tuple[str, int, int]  # (kind F | B | I | W, stage, microbatch)
Event = tuple[str, int, int, float, float]  # an action with its start and end


# --- action tables and the simulator -----------------------------------------------------------


def virtual_stages(schedule: str) -> int:
    """Stages per rank used here: 2 for every multi-stage schedule (V schedules need exactly 2)."""
    return 2 if is_multi_stage(schedule) else 1


def action_table(schedule: str, pp: int, v: int, m: int) -> dict[int, list[Action]]:
    """Per pp rank, its compute actions (kind, stage, microbatch) in the order it runs them.

    GPipe and 1F1B as torch's step loops run them (1F1B: min(m, pp - r) warm-up forwards, then
    B/F pairs). Multi-stage schedules: torch's own `pipeline_order`, which the constructor derives
    from the stages' indices only, so stand-in stages do (no process group); OVERLAP_F_B
    (DualPipeV) runs its F, then its B. `mesh3d.plan._orders` reads the same orders but keeps no
    microbatch index, which the simulator needs (LoopedBFS runs its backwards in reverse
    microbatch order); the (kind, stage) sequence is checked against it here.
    """
    table: dict[int, list[Action]] = {}
    if not is_multi_stage(schedule):
        for r in range(pp):
            warm = m if schedule == "afab" else min(m, pp - r)
            fwd = [("F", r, k) for k in range(m)]
            bwd = [("B", r, k) for k in range(m)]
            order = fwd[:warm]
            for k in range(m - warm):
                order += [bwd[k], fwd[warm + k]]
            table[r] = order + bwd[m - warm :]
    else:
        n = pp * v
        stand_ins = [
            types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=n, stage_index=i,
                                  is_first=i == 0, is_last=i == n - 1, submod=nn.Module())
            for i in stage_ids_of_rank(0, pp, v, schedule)
        ]  # fmt: skip
        order = SCHEDULES[schedule](stand_ins, m).pipeline_order
        for r, actions in order.items():
            subs = (a for act in actions if act is not None for a in act.sub_actions or [act])
            table[r] = [
                (KIND_NAMES[a.computation_type.name], a.stage_index, a.microbatch_index)
                for a in subs
                if a.computation_type.name in KIND_NAMES
            ]
    plan_orders = _orders(types.SimpleNamespace(pp=pp, v=v, m=m, schedule=schedule))[0]
    for r, actions in table.items():
        assert [(k, s) for k, s, _ in actions] == plan_orders[r], (schedule, pp, m, r)
    return table


@dataclass
class Timeline:
    """Where every action of one step ran: per rank, events (kind, stage, mb, start, end)."""

    events: dict[int, list[Event]]

    @property
    def start(self) -> float:
        return min(e[3] for evs in self.events.values() for e in evs)

    @property
    def step(self) -> float:
        """First start to last end."""
        return max(e[4] for evs in self.events.values() for e in evs) - self.start

    def busy(self, rank: int) -> float:
        return sum(e[4] - e[3] for e in self.events[rank])

    @property
    def bubble(self) -> float:
        """Idle time / (ranks x step)."""
        busy = sum(self.busy(r) for r in self.events)
        return 1.0 - busy / (len(self.events) * self.step)

    def shifted(self, scale: float = 1.0) -> dict[str, list[list]]:
        """Events relative to the step's start, times x `scale`, as JSON-ready lists."""
        t0 = self.start
        return {
            str(r): [[k, s, mb, round((a - t0) * scale, 3), round((b - t0) * scale, 3)]
                     for k, s, mb, a, b in evs]
            for r, evs in sorted(self.events.items())
        }  # fmt: skip


def simulate(
    table: dict[int, list[Action]],
    cost: Callable[[str, int], float] | None,
    comm: float = 0.0,
    durations: dict[Action, float] | None = None,
) -> Timeline:
    """Replay `table` with `cost(kind, stage)` per action (or each action's own entry in
    `durations`); `comm` is added to cross-rank edges.

    Dependencies: F(s, k) after F(s-1, k); B or I(s, k) after F(s, k) and after the B or I of
    (s+1, k) (the gradient of its output); W(s, k) after I(s, k). Each rank runs its actions in
    table order, each as soon as the rank is free and its inputs are there. Raises if the table
    cannot finish (an order that would deadlock).
    """
    rank_of = {s: r for r, actions in table.items() for _, s, _ in actions}
    last = max(rank_of)
    fwd_end: dict[tuple[int, int], float] = {}
    grad_end: dict[tuple[int, int], float] = {}  # input gradient of (stage, mb) computed
    input_end: dict[tuple[int, int], float] = {}  # I done (W may run)
    pos = {r: 0 for r in table}
    free = {r: 0.0 for r in table}
    events: dict[int, list[Event]] = {r: [] for r in table}
    left = sum(len(a) for a in table.values())
    while left:
        progressed = False
        for r, actions in table.items():
            while pos[r] < len(actions):
                kind, s, k = actions[pos[r]]
                if kind == "F":
                    deps = [] if s == 0 else [(fwd_end.get((s - 1, k)), s - 1)]
                elif kind in "BI":
                    deps = [(fwd_end.get((s, k)), s)]
                    deps += [] if s == last else [(grad_end.get((s + 1, k)), s + 1)]
                else:
                    deps = [(input_end.get((s, k)), s)]
                if any(t is None for t, _ in deps):
                    break
                ready = [t + (comm if rank_of[d] != r else 0.0) for t, d in deps]
                start = max([free[r], *ready])
                end = start + (durations[kind, s, k] if durations else cost(kind, s))
                events[r].append((kind, s, k, start, end))
                free[r] = end
                if kind == "F":
                    fwd_end[s, k] = end
                else:
                    grad_end[s, k] = end if kind in "BI" else grad_end.get((s, k), end)
                    if kind == "I":
                        input_end[s, k] = end
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: table[r][pos[r]] for r in table if pos[r] < len(table[r])}
            raise RuntimeError(f"the action table cannot finish; next actions {stuck}")
    return Timeline(events)


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


class _Held:
    """What the pack hook gives autograd: the tensor, and a weakref target that dies when
    autograd drops it (after the backward that used it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Bytes saved for backward alive at once, per stage and in all, with their peaks.

    The pack hook sees every tensor autograd saves; storages of parameters are left out, so what
    remains are activations. A storage counts once (by pointer) while any packed handle uses it;
    a weakref finalizer stops counting it when autograd drops the handle. Saved tensors are
    charged to the stage whose forward (or loss) is running (`self.stage`).
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = {self._storage(p).data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [handles, nbytes, stage]
        self.stage = -1
        self.now: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.total = self.total_peak = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.untyped_storage()

    def pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t.detach())  # no grad_fn: a saved output would hold its own node
        storage = self._storage(t)
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.params:
            return held
        entry = self.live.setdefault(key, [0, storage.nbytes(), self.stage])
        if entry[0] == 0:
            self._add(entry[2], entry[1])
        entry[0] += 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _add(self, stage: int, nbytes: int) -> None:
        self.now[stage] = self.now.get(stage, 0) + nbytes
        self.peak[stage] = max(self.peak.get(stage, 0), self.now[stage])
        self.total += nbytes
        self.total_peak = max(self.total_peak, self.total)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self._add(entry[2], -entry[1])
            del self.live[key]


class Recorder:
    """Timestamps of every compute action this rank runs (see the module docstring)."""

    def __init__(self, sync: bool):
        self.events: list[Event] = []
        self.sync = sync
        self.meter: SavedBytes | None = None

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, stage: int) -> float:
        if self.meter is not None:
            self.meter.stage = stage
        return self.now()

    def wrap_stage(self, stage) -> None:
        """Shadow the stage's compute methods with timed ones (instance attributes)."""
        idx = stage.stage_index
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        weight, signature = stage.backward_weight_one_chunk, inspect.signature(backward)

        def forward_one_chunk(chunk: int, *args, **kwargs):
            t0 = self._enter(idx)
            out = forward(chunk, *args, **kwargs)
            self.events.append(("F", idx, chunk, t0, self.now()))
            return out

        def backward_one_chunk(chunk: int, *args, **kwargs):
            full = signature.bind(chunk, *args, **kwargs).arguments.get("full_backward", True)
            t0 = self._enter(idx)
            out = backward(chunk, *args, **kwargs)
            self.events.append(("B" if full else "I", idx, chunk, t0, self.now()))
            return out

        def backward_weight_one_chunk(chunk: int, *args, **kwargs):
            t0 = self._enter(idx)
            out = weight(chunk, *args, **kwargs)
            self.events.append(("W", idx, chunk, t0, self.now()))
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def wrap_loss(self, loss_fn: Callable, last_stage: int) -> Callable:
        """The loss runs right after the last stage's forward: it extends that F."""

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            self._enter(last_stage)
            out = loss_fn(logits, labels)
            kind, s, mb, t0, _ = self.events[-1]
            assert (kind, s) == ("F", last_stage), self.events[-1]
            self.events[-1] = (kind, s, mb, t0, self.now())
            return out

        return loss


def _build(cfg, mesh, device: torch.device, schedule: str, recorder: Recorder):
    """This rank's stages and schedule, as `mesh3d.train.build` makes them, with a timed loss."""
    mc, tok, pp = cfg.model.model_config, cfg.tokens, cfg.parallelism.pp
    v, m = virtual_stages(schedule), tok.batch_accumulation_per_replica
    n, vocab = pp * v, padded_vocab_size(cfg)
    layers = stage_layers(cfg, n)
    with torch.device("meta"):
        full = Llama(mc, vocab_size=vocab, attention=cfg.mesh3d.attention)
    source, mode = initial_weights(cfg, vocab), dp_mode(0, False)
    ids = stage_ids_of_rank(mesh["pp"].get_local_rank(), pp, v, schedule)
    modules = [
        parallelize(build_stage(full, i, n, layers[i]), mesh, device=device, source=source,
                    sequence_parallel=False, recompute_layer=False, dp=mode)
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


# --- simulated mode ------------------------------------------------------------------------------


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


# --- output --------------------------------------------------------------------------------------


def compact_json(obj) -> str:
    """JSON indented by 1, with every innermost list on one line (timeline events stay short).

    Dropping a newline and its indent is safe anywhere: JSON strings cannot hold raw newlines.
    """
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda mt: re.sub(r"\n\s*", "", mt.group(0)), text) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _md(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]


def tables(result: dict) -> str:
    """The markdown report: measured table, simulated table, skipped combinations."""
    out = [
        f"### measured: pp={result['measured_pp']}, real processes ({result['measured_device']})",
        "",
    ]
    head = ["schedule", "m", "v", "step ms", "tokens/s", "bubble measured", "bubble replay",
            "bubble sim", "bubble analytic", "F / B (I, W) ms per stage", "peak saved MiB per rank (plan)"]  # fmt: skip
    rows = []
    for r in result["measured"]:
        stages = sorted({int(k[1:]) for k in r["action_ms"]})
        costs = "; ".join(
            f"{s}: " + " ".join(f"{k}{r['action_ms'][f'{k}{s}']:.0f}" for k in "FBIW" if f"{k}{s}" in r["action_ms"])
            for s in stages
        )  # fmt: skip
        mem = ", ".join(
            f"{a / MiB:.0f} ({b / MiB:.0f})"
            for a, b in zip(r["saved_peak_bytes"], r["saved_plan_bytes"])
        )
        rows.append([r["schedule"], r["m"], r["v"], f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
                     _pct(r["bubble"]), _pct(r["bubble_replay"]), _pct(r["bubble_sim"]),
                     _pct(r["bubble_analytic"]), costs, mem])  # fmt: skip
    out += _md(head, rows)
    for r in result["measured"]:
        if r["schedule"] == "1f1b":
            rel = r["bubble"] / r["bubble_analytic"] - 1
            steps = ", ".join(_pct(b) for b in r["bubble_all"])
            out.append(f"\n1F1B pp={r['pp']} m={r['m']}: measured bubble {_pct(r['bubble'])} vs "
                       f"analytic {_pct(r['bubble_analytic'])} ({rel:+.0%} relative; target within "
                       f"10%); every timed step: {steps}; replayed {_pct(r['bubble_replay'])}, so "
                       f"{_pct(r['bubble'] - r['bubble_replay'])} of the step is communication and "
                       "time between actions")  # fmt: skip
    layer = result["probe"]["layer_ms"]
    out += ["", f"### simulated: {SIM_LAYERS} layers split evenly over pp x v stages; one layer: "
            + ", ".join(f"{k} {layer[k]:.1f} ms" for k in "FBIW") + f" ({result['probe']['device']})", ""]  # fmt: skip
    head = ["schedule", "pp", "m", "v", "step ms", "tokens/s", "bubble sim", "bubble sim (unit)",
            "bubble analytic", "peak saved MiB (max rank)", "in flight (max)"]  # fmt: skip
    rows = [[r["schedule"], r["pp"], r["m"], r["v"], f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
             _pct(r["bubble"]), _pct(r["bubble_unit"]),
             f"{_pct(r['bubble_analytic'])} ({r['analytic_kind']})",
             f"{max(r['saved_peak_bytes']) / MiB:.0f}", max(r["in_flight"])] for r in result["simulated"]]  # fmt: skip
    out += _md(head, rows)
    exact = [r for r in result["simulated"] if r["analytic_kind"] == "exact"]
    equal = sum(abs(r["bubble_unit"] - r["bubble_analytic"]) < 1e-9 for r in exact)
    names = ", ".join(dict.fromkeys(r["schedule"] for r in exact))
    out.append(f"\nUnit costs (F = I = W = 1, B = 2): simulated == analytic in {equal} of {len(exact)} "
               f"rows with an exact closed form ({names}).")  # fmt: skip
    if result["skipped"]:
        out += ["", "### skipped (mesh3d's config validation says why)", ""]
        out += [
            f"- {s['schedule']} pp={s['pp']} m={s['m']} ({s['mode']}): {s['reason']}"
            for s in result["skipped"]
        ]
    return "\n".join(out) + "\n"


COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def _panel(ax, rec: dict, title: str) -> None:
    """One schedule's timeline: a row per rank (rank 0 on top), a box per action."""
    pp, v_shape = rec["pp"], rec["schedule"] in ("zbv_zero_bubble", "dualpipev")
    width = max(e[4] for evs in rec["timeline_ms"].values() for e in evs)
    for r, events in rec["timeline_ms"].items():
        y = pp - 1 - int(r)
        boxes: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for kind, stage, mb, a, b in events:
            second = stage >= pp if v_shape else stage // pp > 0  # the rank's later stage(s)
            boxes.setdefault((kind, int(second)), []).append((a, b - a))
            if b - a > width / 70:
                ax.text(
                    (a + b) / 2, y, str(mb), ha="center", va="center", fontsize=5, color="white"
                )
        for (kind, second), spans in boxes.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white",
                           linewidth=0.4, alpha=0.55 if second else 1.0)  # fmt: skip
    ax.set_yticks(range(pp), [f"rank {pp - 1 - i}" for i in range(pp)], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlim(0, width)
    sim = f", sim {_pct(rec['bubble_sim'])}" if "bubble_sim" in rec else ""
    ax.set_title(f"{rec['schedule']} (v={rec['v']}): {title}; bubble {_pct(rec['bubble'])}{sim}, "
                 f"analytic {_pct(rec['bubble_analytic'])}", fontsize=9)  # fmt: skip


def chart(result: dict, path: Path) -> bool:
    """The timeline chart: a panel per schedule, simulated (left) and measured (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    (pp_sim, m_sim), m_meas = result["chart"]["simulated"], result["chart"]["measured_m"]
    sims = {r["schedule"]: r for r in result["simulated"] if (r["pp"], r["m"]) == (pp_sim, m_sim)}
    meas = {r["schedule"]: r for r in result["measured"] if r["m"] == m_meas}
    columns = [(sims, f"simulated pp={pp_sim} m={m_sim}"),
               (meas, f"measured pp={result['measured_pp']} m={m_meas}")]  # fmt: skip
    names = [n for n in SCHEDULES if n in sims or n in meas]
    fig, axes = plt.subplots(len(names), 2, figsize=(18, 1.0 + 1.45 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, (recs, title) in enumerate(columns):
            if name in recs:
                _panel(axes[row][col], recs[name], title)
            else:
                axes[row][col].set_axis_off()
                axes[row][col].set_title(f"{name}: {title} not run", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("ms", fontsize=8)
    kinds = ("F forward", "B full backward", "I input grad", "W weight grad")
    legend = [Patch(color=c, label=k) for k, c in zip(kinds, COLORS.values())]
    legend.append(Patch(color="grey", alpha=0.55, label="lighter: the rank's 2nd stage"))
    legend.append(Patch(color="white", label="numbers: microbatch"))
    fig.legend(handles=legend, loc="upper center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--tiny", action="store_true", help="a tiny model, seconds (for the test)")
    group.add_argument("--full", action="store_true", help="more repetitions")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results)")
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
    out_dir = a.out or ROOT / "benchmarks/results"
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
