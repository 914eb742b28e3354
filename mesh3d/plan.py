"""Pre-flight plan of a run: `python -m mesh3d.plan CONFIG [--world-size N] [--json] [key=value ...]`.

Prints, for the validated config and without starting any process group: the rank groups, the
layers of each pipeline stage, parameter / gradient / optimizer / activation bytes per rank, the
pipeline bubble, and the communication per step on each mesh axis. `make_plan(cfg, world_size)`
returns it as a `Plan` dataclass, `format_plan(plan)` renders it.

Everything comes from the code training runs: `ParallelDims` for the groups, `split_layers`,
`stage_ids_of_rank` and `build_stage` on a meta model for the stages, `llama_tp_plan` for the dim
tensor parallelism shards, `dp_mode` for the dp axis, torch's schedules for the order of
forwards and backwards on each rank. Bytes per rank (tests/test_plan.py compares params, grads
and optimizer state with a real 2x2x2 run, exactly, and activations with saved-tensor hooks):
- params: local elements x param dtype (fp32 under `accumulate_grad_in_fp32`: master weights).
  TP splits a dim like `torch.chunk`; FSDP2 (zero_stage 1 or full_shard, dp > 1) then chunks
  dim 0 of the tp-local tensor over dp: ceil(rows / dp) each, the last ranks get what is left;
- grads, at the optimizer step: as the params, except zero_stage 0 with tp > 1, where an untied
  embedding's gradient is `Replicate()`: the full padded [V, h] on every tp rank;
- optimizer: AdamW exp_avg + exp_avg_sq in the param dtype and a 4-byte `step` per parameter;
  SGD (no momentum in mesh3d) none;
- activations: `stage_activation_bytes` per microbatch, times what is in flight (`_peaks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
import types
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mesh3d.config import effective_pp_schedule, load_config, padded_vocab_size, validate
from mesh3d.errors import exit_on_user_error
from mesh3d.mesh import ParallelDims
from mesh3d.models.llama import Llama
from mesh3d.parallel.parallelize import dp_mode
from mesh3d.parallel.pipeline import (
    SCHEDULES,
    build_stage,
    is_multi_stage,
    rank_of_stage,
    split_layers,
    stage_ids_of_rank,
)
from mesh3d.parallel.tensor import llama_tp_plan
from mesh3d.train.build import param_and_compute_dtypes

# bytes one rank sends per byte of payload, ring algorithms over n ranks
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
WIRE |= {"reduce_scatter": WIRE["all_gather"], "send": lambda n: 1.0}


@dataclass
class StagePlan:
    stage: int
    pp_rank: int
    layers: list[int]  # decoder layer indices
    embedding: bool
    head: bool  # final norm + lm_head
    saved_per_microbatch: int  # bytes saved for backward (stage_activation_bytes)
    held_per_microbatch: int  # bytes of the output the schedule keeps until backward


@dataclass
class CommItem:
    """One kind of collective or send of one rank per step."""

    axis: str
    what: str
    collective: str  # all_reduce | all_gather | reduce_scatter | send
    count: int
    bytes_each: int  # the full tensor (all-gather output, reduce-scatter input)
    sent_bytes: int  # what the rank puts on the wire: count x bytes_each x WIRE[collective]


@dataclass
class RankPlan:
    rank: int
    coords: dict[str, int]
    stages: list[int]
    param_elements: int
    param_bytes: int
    grad_bytes: int  # at the optimizer step
    optimizer_bytes: int
    saved_activation_bytes: int  # peak over the step of the bytes saved for backward
    activation_bytes: int  # peak of saved + the outputs held by the schedule
    microbatches_in_flight: int  # peak of (stage, microbatch) forwards not yet released
    transient: dict[str, int]  # bytes alive during part of the step, by cause
    peak_bytes: int  # upper estimate: all of the above alive at once
    comm: list[CommItem]


@dataclass
class Bubble:
    fraction: float | None  # idle share of a step; None: no closed form
    formula: str
    kind: str  # exact | approximate | ideal | none


@dataclass
class Plan:
    """The whole plan; `dataclasses.asdict(plan)` is what `--json` prints."""

    world_size: int
    dims: dict[str, int]
    schedule: str
    virtual_stages: int
    microbatches: int
    micro_batch_size: int
    sequence_length: int
    dp_mode: str
    tp_mode: str
    param_dtype: str
    compute_dtype: str
    optimizer: str
    recompute_layer: bool
    tied_embeddings: bool
    padded_vocab: int
    total_params: int  # the whole model, a tied embedding once
    groups: dict[str, list[list[int]]]
    stages: list[StagePlan]
    ranks: list[RankPlan]
    bubble: Bubble
    order_source: str  # where each rank's order of forwards and backwards comes from
    notes: list[str]


@dataclass(frozen=True)
class _Sizes:
    """The numbers every estimate uses, read once from a config."""

    b: int  # micro_batch_size
    s: int  # sequence_length
    h: int
    ffn: int
    heads: int
    kv_heads: int
    tp: int
    dp: int
    pp: int
    v: int  # stages per pp rank
    m: int  # microbatches per step
    vocab: int  # real
    padded: int
    e_p: int  # bytes of the param dtype
    e_c: int  # bytes of the compute dtype (autocast, else the param dtype)
    autocast: bool
    sp: bool  # sequence parallel (tp_mode REDUCE_SCATTER, tp > 1)
    recompute: bool
    fsdp: bool  # FSDP2 on dp: zero_stage 1 or full_shard, dp > 1
    mode: str  # dp_mode
    schedule: str

    @classmethod
    def of(cls, cfg) -> _Sizes:
        p, t, mc = cfg.parallelism, cfg.tokens, cfg.model.model_config
        param, autocast = param_and_compute_dtypes(cfg)
        mode = dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard)
        return cls(
            t.micro_batch_size, t.sequence_length, mc.hidden_size, mc.intermediate_size,
            mc.num_attention_heads, mc.num_key_value_heads or mc.num_attention_heads,
            p.tp, p.dp, p.pp, cfg.mesh3d.pp_virtual_stages,
            t.batch_accumulation_per_replica, mc.vocab_size, padded_vocab_size(cfg),
            param.itemsize, (autocast or param).itemsize, autocast is not None,
            p.tp_mode == "REDUCE_SCATTER" and p.tp > 1, p.recompute_layer,
            mode != "replicate" and p.dp > 1, mode, effective_pp_schedule(cfg),
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def local_tokens(self) -> int:  # the residual stream's tokens on a tp rank
        return self.tokens // self.tp if self.sp else self.tokens


def stage_activation_bytes(cfg, layers: int, embedding: bool, head: bool) -> tuple[int, int]:
    """(bytes saved for backward, bytes of the held output) of one stage and microbatch.

    T = b·s tokens, T' = T/tp under sequence parallelism else T, e_p / e_c the bytes of the
    param / compute dtype, h, F, nq the hidden, ffn and head sizes, dh = h/nq. A decoder layer:

        2·T'·(h·(4 + e_p) + 4)    its two RMSNorms: fp32 input, normalized input, 1/rms
      + k·T·h·e_c                 q/k/v and gate/up inputs (gathered under SP): k = 2, or 5
                                  under autocast, which saves one cast copy per linear
      + 2·T·(h/tp)·e_c            q and the attention output (nq heads)
      + 2·T·(nkv·dh/tp)·e_c       k and v (nkv heads: SDPA's enable_gqa keeps them unrepeated)
      + 4·b·(nq/tp)·s + 16·s·dh   logsumexp and RoPE cos/sin (fp32)
      + 4·T·(F/tp)·e_c            gate output, its activation, up output, their product

    or, with `recompute_layer`, its input T'·h·e_p. The first stage adds the ids 8·T; the last
    adds its norm T'·(h·(4 + e_p) + 4), the lm_head input T·h·e_c, the fp32 log-softmax
    4·T·V' (V' = the real vocab at tp 1, else the padded V/tp) and the labels 8·T + 4. Held
    until backward: the logits T·(V/tp)·e_c on the last stage, else the output T'·h·e_p.
    Measured exact on CPU (SDPA) in fp32, bf16 and bf16 autocast.
    """
    z = _Sizes.of(cfg)
    norm = z.local_tokens * (z.h * (4 + z.e_p) + 4)
    if z.recompute:
        layer = z.local_tokens * z.h * z.e_p
    else:
        layer = 2 * norm + (5 if z.autocast else 2) * z.tokens * z.h * z.e_c
        kv = z.kv_heads * (z.h // z.heads)
        layer += 2 * z.tokens * (z.h // z.tp) * z.e_c + 2 * z.tokens * (kv // z.tp) * z.e_c
        layer += 4 * z.tokens * (z.ffn // z.tp) * z.e_c
        layer += 4 * z.b * (z.heads // z.tp) * z.s + 16 * z.s * (z.h // z.heads)
    saved = layers * layer + 8 * z.tokens * embedding
    if head:
        loss_vocab = z.vocab if z.tp == 1 else z.padded // z.tp
        saved += norm + z.tokens * z.h * z.e_c + 4 * z.tokens * loss_vocab + 8 * z.tokens + 4
    held = z.tokens * (z.padded // z.tp) * z.e_c if head else z.local_tokens * z.h * z.e_p
    return saved, held


@dataclass
class _Param:
    """One parameter as one rank holds it, in elements."""

    name: str
    local: int  # the rank's shard
    tp_local: int  # before dp sharding
    gathered: int  # what FSDP all-gathers: dp x the ceil-sized shard
    grad: int  # the gradient at the optimizer step
    matmul: bool  # a linear weight: autocast keeps a cast copy


def _chunk(n: int, parts: int, index: int) -> int:
    """len(torch.chunk(range(n), parts)[index]), 0 past the last chunk (DTensor, FSDP2 dims)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def _tp_dim(module: nn.Module, name: str, plan: dict) -> int | None:
    """The dim the TP plan shards parameter `name` on; None: replicated."""
    path = name.rpartition(".")[0].split(".")
    for pattern, style in plan.items():
        parts = pattern.split(".")
        if len(parts) == len(path) and all(map(fnmatch.fnmatch, path, parts)):
            emb = isinstance(module.get_submodule(".".join(path)), nn.Embedding)
            if isinstance(style, ColwiseParallel):  # Linear: out features; Embedding: h
                return 1 if emb else 0
            if isinstance(style, RowwiseParallel):  # Linear: in features; Embedding: vocab
                return 0 if emb else 1
    return None


def _params(z: _Sizes, module: nn.Module, coords: dict[str, int], tied: bool) -> list[_Param]:
    """Every parameter of one meta stage module as the rank at `coords` holds it."""
    plan = llama_tp_plan(z.sp) if z.tp > 1 else {}
    head = getattr(module, "lm_head", None)
    out = []
    for name, param in module.named_parameters():  # a tied head shares the embedding's
        shape = list(param.shape)
        dim = _tp_dim(module, name, plan)
        if dim is not None:
            shape[dim] = _chunk(shape[dim], z.tp, coords["tp"])
        row = math.prod(shape[1:])
        local = tp_local = gathered = row * shape[0]
        if z.fsdp:
            local = _chunk(shape[0], z.dp, coords["dp"]) * row
            gathered = -(-shape[0] // z.dp) * z.dp * row
        replicated = z.tp > 1 and z.mode == "replicate" and not tied and name.startswith("embed")
        grad = param.numel() if replicated else local
        matmul = name.endswith("proj.weight") or name == "lm_head.weight"
        matmul |= head is not None and param is head.weight
        out.append(_Param(name, local, tp_local, gathered, grad, matmul))
    return out


def _orders(z: _Sizes) -> tuple[dict[int, list[tuple[str, int]]], str]:
    """Per pp rank, its (op, stage) sequence: F forward, B backward, I input backward (frees
    the held output), W weight backward (frees what was saved).

    GPipe and 1F1B as torch's step loops run them (1F1B: min(m, pp - r) warm-up forwards, then
    B/F pairs). Multi-stage schedules: torch's own `pipeline_order`, which their constructors
    compute from the stages' sizes only, so stand-in stages do (no process group). If that
    private API fails, every chunk is taken to be in flight at once: an upper bound.
    """
    pp, v, m, name = z.pp, z.v, z.m, z.schedule
    if pp == 1:
        return {0: [("F", 0), ("B", 0)] * m}, "no pipeline: one microbatch at a time"
    if not is_multi_stage(name):
        orders = {}
        for r in range(pp):
            warm = m if name == "afab" else min(m, pp - r)
            orders[r] = [("F", r)] * warm + [("B", r), ("F", r)] * (m - warm) + [("B", r)] * warm
        return orders, f"the {SCHEDULES[name].__name__} step loop"
    ids, n = stage_ids_of_rank(0, pp, v, name), pp * v
    stand_ins = [
        types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=n, stage_index=i,
                              is_first=i == 0, is_last=i == n - 1, submod=nn.Module())
        for i in ids
    ]  # fmt: skip
    try:
        order = SCHEDULES[name](stand_ins, m).pipeline_order
    except Exception as e:  # torch-private: say so and bound
        mine = {r: stage_ids_of_rank(r, pp, v, name) for r in range(pp)}
        ops = {r: [(k, s) for k in "FB" for s in mine[r] for _ in range(m)] for r in range(pp)}
        return ops, f"an upper bound, all chunks in flight ({SCHEDULES[name].__name__}: {e!r})"
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    orders = {r: [] for r in range(pp)}
    for r, actions in order.items():
        for action in filter(None, actions):
            for a in action.sub_actions or [action]:  # OVERLAP_F_B: F then B
                if a.computation_type.name in kinds:
                    orders[r].append((kinds[a.computation_type.name], a.stage_index))
    return orders, f"torch {SCHEDULES[name].__name__}.pipeline_order"


def _peaks(ops, saved: dict[int, int], held: dict[int, int]) -> tuple[int, int, int]:
    """(peak saved, peak saved + held, peak chunks in flight) over one rank's op sequence."""
    now, peak = [0, 0, 0], [0, 0, 0]  # saved, held, chunks
    for op, s in ops:
        sign = 1 if op == "F" else -1
        if op in "FBW":
            now[0] += sign * saved[s]
            now[2] += sign
        if op in "FBI":
            now[1] += sign * held[s]
        peak = [max(peak[0], now[0]), max(peak[1], now[0] + now[1]), max(peak[2], now[2])]
    return peak[0], peak[1], peak[2]


def bubble(schedule: str, pp: int, v: int, m: int) -> Bubble:
    """Idle share of a step with equal stage times (and F = I = W for the split backward)."""
    if pp == 1:
        return Bubble(0.0, "no pipeline", "exact")
    if schedule in ("afab", "1f1b"):
        return Bubble((pp - 1) / (m + pp - 1), "(pp-1)/(m+pp-1)", "exact")
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return Bubble((pp - 1) / (v * m + pp - 1), "(pp-1)/(v*m+pp-1)", "exact")
    if schedule == "interleaved_zero_bubble":
        why = "(pp-1)/(3*v*m+pp-1): ZB1P idles (pp-1)(F+B-2W), F = I = W, chunks 1/v long"
        return Bubble((pp - 1) / (3 * v * m + pp - 1), why, "approximate")
    if schedule == "zbv_zero_bubble":
        return Bubble(0.0, "0 when F = I = W and m >= 2pp-1 (ZB-V, Qi et al. 2024)", "ideal")
    return Bubble(None, "no closed form; DualPipe idles (pp/2-1)(F&B+B-3W)", "none")


def _comm(z: _Sizes, stages: list[StagePlan], params: list[_Param], tied_peer: bool):
    """What one rank sends per step on each axis; payloads in the dtype that travels."""
    m, tokens, h = z.m, z.tokens, z.h
    layers = sum(len(s.layers) for s in stages)
    emb, head = m * any(s.embedding for s in stages), m * any(s.head for s in stages)
    fwd, bwd = 2 * layers * m * (1 + z.recompute), 2 * layers * m  # recompute reruns forwards
    r, c = tokens * h * z.e_p, tokens * h * z.e_c  # residual / norm outputs, linear outputs
    if z.sp:
        norms = sum(p.local for p in params if "norm" in p.name) * z.e_p
        tp = [("norm outputs into q/k/v, gate/up (fwd)", "all_gather", fwd, r),
              ("o_proj, down_proj outputs (fwd)", "reduce_scatter", fwd, c),
              ("o_proj, down_proj output grads (bwd)", "all_gather", bwd, c),
              ("norm output grads (bwd)", "reduce_scatter", bwd, r),
              ("embedding output (fwd)", "reduce_scatter", emb, r),
              ("embedding output grad (bwd)", "all_gather", emb, r),
              ("lm_head input (fwd)", "all_gather", head, r),
              ("lm_head input grad (bwd)", "reduce_scatter", head, r),
              ("norm weight grads", "all_reduce", 1, norms)]  # fmt: skip
    else:
        tp = [("o_proj, down_proj outputs (fwd)", "all_reduce", fwd, c),
              ("attention, MLP input grads (bwd)", "all_reduce", bwd, r),
              ("embedding output (fwd)", "all_reduce", emb, r),
              ("lm_head input grad (bwd)", "all_reduce", head, r)]  # fmt: skip
    tp.append(("loss: max, sum of exp, target logit (fwd)", "all_reduce", 3 * head, 4 * tokens))
    last = z.pp * z.v - 1
    sends = m * sum((s.stage != last) + (s.stage != 0) for s in stages)
    pp = [("activations (fwd), their grads (bwd)", "send", sends, z.local_tokens * h * z.e_p)]
    if tied_peer:
        tied = next(p.grad for p in params if p.name in ("embed_tokens.weight", "lm_head.weight"))
        pp.append(("tied embedding grad", "send", 1, tied * z.e_p))
    if z.mode == "replicate":
        dp = [("grads, one flat buffer", "all_reduce", 1, sum(p.grad for p in params) * z.e_p)]
    else:  # FSDP2: all units of the rank together; the pipeline defers reduce (and reshard)
        many = m if z.pp == 1 else 1
        gathers = 2 * m if z.mode == "full" else many  # full with pp > 1: a bound
        gathered = sum(p.gathered for p in params) * z.e_p
        dp = [("parameters (FSDP unshard)", "all_gather", gathers, gathered),
              ("grads", "reduce_scatter", many, gathered)]  # fmt: skip
    items = []
    for axis, rows, n in (("tp", tp, z.tp), ("pp", pp, z.pp), ("dp", dp, z.dp)):
        for what, kind, count, each in rows:
            if count and each and n > 1:
                sent = round(count * each * WIRE[kind](n))
                items.append(CommItem(axis, what, kind, count, each, sent))
    return items


def _transient(
    z: _Sizes, params: list[_Param], stages: list[int], one_layer: int
) -> dict[str, int]:
    """Bytes alive during part of the step, by cause."""
    out = {}
    if z.fsdp:
        units: dict[str, int] = {}  # FSDP units: each decoder layer, the rest ("root")
        for p in params:
            parts = p.name.split(".")
            key = parts[1] if parts[0] == "layers" else "root"
            units[key] = units.get(key, 0) + p.gathered * z.e_p
        layers = sorted((b for k, b in units.items() if k != "root"), reverse=True)
        if z.mode == "zero1" or z.pp > 1:
            out["fsdp_gathered_params"] = sum(units.values())
        else:  # full shard, no pipeline: the root, the running layer and the prefetched one
            out["fsdp_gathered_params"] = units.get("root", 0) + sum(layers[:2])
        if z.pp > 1:  # schedules accumulate unsharded gradients until the last backward
            out["fsdp_unsharded_grads"] = sum(p.tp_local for p in params) * z.e_p
    if z.autocast:
        out["autocast_weight_copies"] = sum(p.tp_local for p in params if p.matmul) * z.e_c
    if z.recompute:
        out["recomputed_layer"] = one_layer
    if z.pp > 1:  # a receive buffer per microbatch, stage input and output gradient
        last = z.pp * z.v - 1
        n = sum((s != 0) + (s != last) for s in stages) * z.m
        out["pp_recv_buffers"] = n * z.local_tokens * z.h * z.e_p
    return {k: b for k, b in out.items() if b}


def make_plan(cfg, world_size: int | None = None) -> Plan:
    """The plan of `cfg` on `world_size` processes (default dp x tp x pp). A config training
    would refuse raises the same ConfigError.



    Example:



        print(mesh3d.plan.format_plan(mesh3d.make_plan(cfg, world_size=8)))


    """
    validate(cfg, world_size=world_size)
    z, mc = _Sizes.of(cfg), cfg.model.model_config
    dims = ParallelDims(dp=z.dp, tp=z.tp, pp=z.pp)
    n = z.pp * z.v
    split = split_layers(mc.num_hidden_layers, n, z.h, z.ffn, z.heads, z.h // z.heads, z.padded)
    with torch.device("meta"):
        full = Llama(mc, vocab_size=z.padded, attention="sdpa")  # shapes only
    modules = [full] if n == 1 else [build_stage(full, i, n, split[i]) for i in range(n)]
    stages = []
    for i in range(n):
        saved, held = stage_activation_bytes(cfg, len(split[i]), i == 0, i == n - 1)
        pp_rank = rank_of_stage(i, z.pp, z.schedule) if z.pp > 1 else 0
        stages.append(StagePlan(i, pp_rank, split[i], i == 0, i == n - 1, saved, held))
    orders, source = _orders(z)
    plain = dataclasses.replace(cfg.parallelism, recompute_layer=False)
    one_layer = stage_activation_bytes(
        dataclasses.replace(cfg, parallelism=plain), 1, False, False
    )[0]
    tied = mc.tie_word_embeddings
    ends = {stages[0].pp_rank, stages[-1].pp_rank}
    adamw = cfg.optimizer.optimizer_factory.name != "sgd"
    saved = {s.stage: s.saved_per_microbatch for s in stages}
    held = {s.stage: s.held_per_microbatch for s in stages}
    ranks = []
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        ids = stage_ids_of_rank(coords["pp"], z.pp, z.v, z.schedule) if z.pp > 1 else [0]
        params = [x for i in ids for x in _params(z, modules[i], coords, tied)]
        elements = sum(x.local for x in params)
        grads = sum(x.grad for x in params) * z.e_p
        optim = sum(2 * x.local * z.e_p + 4 for x in params) if adamw else 0
        peak_saved, peak_act, in_flight = _peaks(orders[coords["pp"]], saved, held)
        transient = _transient(z, params, ids, one_layer)
        peak = elements * z.e_p + grads + optim + peak_act + sum(transient.values())
        tied_peer = tied and len(ends) == 2 and coords["pp"] in ends
        comm = _comm(z, [stages[i] for i in ids], params, tied_peer)
        ranks.append(
            RankPlan(
                rank=rank, coords=coords, stages=ids, param_elements=elements,
                param_bytes=elements * z.e_p, grad_bytes=grads, optimizer_bytes=optim,
                saved_activation_bytes=peak_saved, activation_bytes=peak_act,
                microbatches_in_flight=in_flight, transient=transient, peak_bytes=peak, comm=comm,
            )
        )  # fmt: skip
    param_dtype, autocast = param_and_compute_dtypes(cfg)
    return Plan(
        world_size=dims.world_size, dims={"pp": z.pp, "dp": z.dp, "tp": z.tp},
        schedule=z.schedule if z.pp > 1 else "none", virtual_stages=z.v, microbatches=z.m,
        micro_batch_size=z.b, sequence_length=z.s, dp_mode=z.mode, tp_mode=cfg.parallelism.tp_mode,
        param_dtype=_dtype(param_dtype), compute_dtype=_dtype(autocast or param_dtype),
        optimizer=cfg.optimizer.optimizer_factory.name, recompute_layer=z.recompute,
        tied_embeddings=tied, padded_vocab=z.padded,
        total_params=sum(p.numel() for p in full.parameters()),
        groups={axis: dims.groups(axis) for axis in ("tp", "pp", "dp")}, stages=stages,
        ranks=ranks, bubble=bubble(z.schedule, z.pp, z.v, z.m), order_source=source,
        notes=_notes(z, tied),
    )  # fmt: skip


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _notes(z: _Sizes, tied: bool) -> list[str]:
    notes = []
    if z.mode == "replicate" and z.tp > 1 and not tied:
        notes.append("zero_stage 0, tp > 1: the untied embedding's gradient is Replicate(), the "
                     "full padded [V, h] on each tp rank (in grads and the dp all-reduce)")  # fmt: skip
    if z.fsdp and z.pp > 1:
        notes.append("FSDP under a pipeline schedule keeps gradients unsharded (and zero1 the "
                     "parameters gathered) until the step's last backward")  # fmt: skip
    if z.mode == "full" and z.pp > 1:
        notes.append(
            "full_shard with pp > 1: the dp all-gather count is a bound (2 per microbatch)"
        )
    if z.autocast:
        notes.append("autocast keeps a cast copy of each linear weight for the step")
    return notes


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for x in xs:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _table(head: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Cells padded to their column's width: the first `left` columns left, the rest right."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        padded = (
            x.ljust(w) if i < left else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths))
        )
        return "  " + "  ".join(padded).rstrip()

    return [line(head), *map(line, rows)]


def _by_value(plan: Plan, key) -> dict[tuple, list[RankPlan]]:
    """Ranks grouped by `key(rank)`, in rank order: identical rows print once."""
    groups: dict[tuple, list[RankPlan]] = {}
    for r in plan.ranks:
        groups.setdefault(key(r), []).append(r)
    return groups


def format_plan(plan: Plan) -> str:
    """The plan as a text report with aligned tables."""
    d, b = plan.dims, plan.bubble
    out = [
        f"mesh3d plan: {plan.world_size} ranks = pp {d['pp']} x dp {d['dp']} x tp {d['tp']}; "
        f"{plan.total_params:,} parameters (vocab padded to {plan.padded_vocab}, tied "
        f"{plan.tied_embeddings})",
        f"  per dp rank and step: {plan.microbatches} microbatch(es) of {plan.micro_batch_size} x "
        f"{plan.sequence_length} tokens; params {plan.param_dtype}, compute {plan.compute_dtype}, "
        f"{plan.optimizer}; dp {plan.dp_mode}, tp {plan.tp_mode}, recompute {plan.recompute_layer}",
        "",
        "1. Rank groups",
        *(f"  {a}: " + " ".join(map(str, plan.groups[a])) for a in ("tp", "pp", "dp")),
        "",
        f"2. Pipeline stages ({plan.schedule}, {plan.virtual_stages} per pp rank)",
    ]
    rows = [[str(s.stage), str(s.pp_rank), _ranges(s.layers) or "-",
             ", ".join(x for x, on in (("embedding", s.embedding), ("norm, lm_head", s.head)) if on)
             or "-"]
            for s in plan.stages]  # fmt: skip
    out += _table(["stage", "pp rank", "decoder layers", "also"], rows, left=4)
    out += ["", "3. Memory per rank (grads at the optimizer step; peak: every term at once)"]
    keys = ("stages", "param_elements", "param_bytes", "grad_bytes", "optimizer_bytes",
            "activation_bytes", "microbatches_in_flight", "transient", "peak_bytes")  # fmt: skip
    groups = _by_value(plan, lambda r: tuple(str(getattr(r, k)) for k in keys))
    rows = [[_ranges([r.rank for r in g]), ",".join(map(str, g[0].stages)),
             f"{g[0].param_elements:,}", *(_size(getattr(g[0], k)) for k in keys[2:6]),
             str(g[0].microbatches_in_flight), _size(sum(g[0].transient.values())),
             _size(g[0].peak_bytes)] for g in groups.values()]  # fmt: skip
    head = ["ranks", "stages", "params", "param B", "grad B", "optim B", "activations",
            "in flight", "transient", "peak"]  # fmt: skip
    out += _table(head, rows, left=2)
    for g in groups.values():
        if g[0].transient:
            items = ", ".join(f"{k} {_size(v)}" for k, v in g[0].transient.items())
            out.append(f"  transient, ranks {_ranges([r.rank for r in g])}: {items}")
    out += ["", "4. Activations per microbatch (stage_activation_bytes)"]
    rows = [[str(s.stage), _size(s.saved_per_microbatch), _size(s.held_per_microbatch)]
            for s in plan.stages]  # fmt: skip
    out += _table(["stage", "saved for backward", "held output"], rows, left=1)
    out.append(f"  in flight from {plan.order_source}")
    value = "n/a" if b.fraction is None else f"{b.fraction:.1%}"
    out += ["", f"5. Pipeline bubble: {value} ({b.kind}: {b.formula})", ""]
    out.append("6. Communication per step (payload: full tensor; sent: by this rank, ring)")
    for g in _by_value(plan, lambda r: tuple(map(str, r.comm))).values():
        sent = {a: sum(c.sent_bytes for c in g[0].comm if c.axis == a) for a in ("tp", "pp", "dp")}
        totals = ", ".join(f"{a} {_size(v)}" for a, v in sent.items())
        out.append(f"  ranks {_ranges([r.rank for r in g])} send {totals}")
        rows = [[c.axis, c.what, c.collective, str(c.count), _size(c.bytes_each),
                 _size(c.sent_bytes)] for c in g[0].comm]  # fmt: skip
        out += _table(["axis", "what", "collective", "count", "payload", "sent"], rows, left=3)
    out += ["", "Notes:", *(f"  - {n}" for n in plan.notes)] if plan.notes else []
    return "\n".join(out) + "\n"


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mesh3d.plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="Nanotron YAML config file")
    ap.add_argument("--world-size", type=int, help="number of processes (default: dp x tp x pp)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallelism.tp=2")
    args = ap.parse_intermixed_args(argv)
    plan = make_plan(load_config(args.config, args.overrides), args.world_size)
    out = json.dumps(dataclasses.asdict(plan), indent=1) + "\n" if args.json else format_plan(plan)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()
