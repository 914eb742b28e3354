"""`make_plan`: the estimates of the other modules put together for every rank of a config."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mesh3d import extensions
from mesh3d.checks import validate
from mesh3d.layout import lora_plan_of, param_and_compute_dtypes
from mesh3d.mesh import ParallelDims
from mesh3d.models.registry import model_shape, spec_named, spec_of
from mesh3d.parallel.experts import ep_groups
from mesh3d.parallel.pipeline import build_stage, rank_of_stage, split_by_cost, stage_ids_of_rank
from mesh3d.plan.activations import loss_saved_bytes, stage_activation_bytes
from mesh3d.plan.comm import _comm
from mesh3d.plan.memory import _params, _Shape, _shapes, _transient
from mesh3d.plan.records import Plan, RankPlan, StagePlan
from mesh3d.plan.schedule import _orders, _peaks, bubble
from mesh3d.plan.sizes import _Sizes


def make_plan(cfg, world_size: int | None = None) -> Plan:
    """The plan of `cfg` on `world_size` processes (default dp x cp x tp x pp). A config training
    would refuse raises the same ConfigError.

    Example:

        print(mesh3d.plan.format_plan(mesh3d.make_plan(cfg, world_size=8)))
    """
    validate(cfg, world_size=world_size)
    z = _Sizes.of(cfg)
    dims = ParallelDims(dp=z.dp, tp=z.tp, pp=z.pp, cp=z.cp)
    full, split, shapes = stage_shapes(cfg, z)
    basis = plan_basis(cfg, z, split, shapes, _orders(z))
    stages, source = basis.stages, basis.order_source
    ranks = [rank_plan(z, basis, r, dims.coords(r)) for r in range(dims.world_size)]
    param_dtype, autocast = param_and_compute_dtypes(cfg)
    return Plan(
        world_size=dims.world_size, dims={"pp": z.pp, "dp": z.dp, "cp": z.cp, "tp": z.tp},
        schedule=z.schedule if z.pp > 1 else "none", virtual_stages=z.v, microbatches=z.m,
        micro_batch_size=z.b, sequence_length=z.s, dp_mode=z.mode, tp_mode=cfg.parallelism.tp_mode,
        param_dtype=_dtype(param_dtype), compute_dtype=_dtype(autocast or param_dtype),
        optimizer=cfg.optimizer.optimizer_factory.name, recompute_layer=z.recompute,
        tied_embeddings=basis.tied, padded_vocab=z.padded,
        total_params=sum(p.numel() for n, p in full.named_parameters() if not _adapter(n)),
        trainable_params=sum(p.numel() for n, p in full.named_parameters()
                             if _adapter(n) or cfg.mesh3d.lora is None),  # fmt: skip
        active_params=sum(p.numel() for n, p in full.named_parameters() if not _adapter(n))
        - _idle_experts(z),
        groups=_groups(z, dims), stages=stages,
        ranks=ranks, bubble=bubble(z.schedule, z.pp, z.v, z.m), order_source=source,
        notes=_notes(z), moe=_moe(z),
    )  # fmt: skip


@dataclasses.dataclass
class PlanBasis:
    """What every rank's plan reads: the stages, the schedule's orders, the bytes per chunk."""

    stages: list[StagePlan]
    orders: dict[int, list[tuple[str, int]]]
    order_source: str
    shapes: list[list[_Shape]]
    one_layer: int  # what a recomputed layer saves: the largest kind of layer
    loss: dict[int, int]  # stage -> the loss's saved bytes, freed at I by a split backward
    tied: bool
    ends: set[int]  # the pp ranks of the first and last stages
    adamw: bool


def plan_basis(cfg, z: _Sizes, split, shapes, orders) -> PlanBasis:
    """The rank-independent part of a plan (`orders`: `schedule._orders(z)`)."""
    n = z.pp * z.v
    stages = []
    for i in range(n):
        saved, held = stage_activation_bytes(cfg, split[i], i == 0, i == n - 1)
        pp_rank = rank_of_stage(i, z.pp, z.schedule) if z.pp > 1 else 0
        stages.append(StagePlan(i, pp_rank, split[i], i == 0, i == n - 1, saved, held))
    plain = dataclasses.replace(
        cfg, parallelism=dataclasses.replace(cfg.parallelism, recompute_layer=False),
        mesh3d=dataclasses.replace(cfg.mesh3d, recompute=None, recompute_every=1),
    )  # fmt: skip
    one_layer = max(
        stage_activation_bytes(plain, [i], False, False)[0] for i in {0, *z.moe_layers[:1]}
    )
    return PlanBasis(
        stages, orders[0], orders[1], shapes, one_layer, {n - 1: loss_saved_bytes(cfg)},
        model_shape(cfg).tied, {stages[0].pp_rank, stages[-1].pp_rank},
        cfg.optimizer.optimizer_factory.name != "sgd",
    )  # fmt: skip


def rank_plan(
    z: _Sizes, b: PlanBasis, rank: int, coords: dict[str, int], params=None, peaks=None
) -> RankPlan:
    """One rank's memory and communication (`coords`: its pp, dp, cp, tp indices). `params`
    (its stages' `_params`) and `peaks` (`_peaks` of its order) if already known."""
    ids = stage_ids_of_rank(coords["pp"], z.pp, z.v, z.schedule) if z.pp > 1 else [0]
    if params is None:
        params = [x for i in ids for x in _params(z, b.shapes[i], coords)]
    elements = sum(x.local for x in params)
    grads = sum(x.grad for x in params) * z.e_p
    optim = sum(2 * x.local * z.e_p + 4 for x in params if x.trains) if b.adamw else 0
    peak_saved, peak_act, in_flight = peaks or rank_peaks(b, coords["pp"])
    transient = _transient(z, params, ids, b.one_layer)
    peak = elements * z.e_p + grads + optim + peak_act + sum(transient.values())
    tied_peer = b.tied and len(b.ends) == 2 and coords["pp"] in b.ends
    split = [len(b.shapes[i]) for i in ids]
    comm = _comm(z, [b.stages[i] for i in ids], params, tied_peer, split)
    return RankPlan(
        rank=rank, coords=coords, stages=ids, param_elements=elements,
        param_bytes=elements * z.e_p, grad_bytes=grads, optimizer_bytes=optim,
        saved_activation_bytes=peak_saved, activation_bytes=peak_act,
        microbatches_in_flight=in_flight, transient=transient, peak_bytes=peak, comm=comm,
    )  # fmt: skip


def rank_peaks(b: PlanBasis, pp_rank: int) -> tuple[int, int, int]:
    """`_peaks` of one pp rank's order: (peak saved, peak saved + held, chunks in flight)."""
    saved = {s.stage: s.saved_per_microbatch for s in b.stages}
    held = {s.stage: s.held_per_microbatch for s in b.stages}
    return _peaks(b.orders[pp_rank], saved, held, b.loss)


def stage_shapes(cfg, z: _Sizes) -> tuple[nn.Module, list[list[int]], list[list[_Shape]]]:
    """(the whole meta model, each stage's decoder layers, each stage's parameters): the cut
    training makes (`split_by_cost`, `build_stage`), shapes only."""
    mc, n = cfg.model.model_config, z.pp * z.v
    spec = spec_of(mc)
    split = split_by_cost(*spec.pipeline_costs(model_shape(cfg)), n)
    with torch.device("meta"):
        full = spec.build(mc, vocab_size=z.padded, attention="sdpa")
    lora = lora_plan_of(cfg)
    if lora is not None:  # the adapters, shapes only (their tp split: `_shapes`)
        extensions.load("lora").inject(full, lora)
    modules = [full] if n == 1 else [build_stage(full, i, n, split[i]) for i in range(n)]
    return full, split, [_shapes(z, m, lora) for m in modules]


def _groups(z: _Sizes, dims: ParallelDims) -> dict[str, list[list[int]]]:
    """The mesh axes' rank groups; under expert parallelism also the ep groups and the expert
    replica groups (the ranks holding the same experts), as training builds them."""
    groups = {axis: dims.groups(axis) for axis in ("tp", "cp", "pp", "dp")}
    if z.ep > 1:
        groups["ep"], groups["expert_replicas"] = ep_groups(dims.world_size, dims, z.ep)
    return groups


def _idle_experts(z: _Sizes) -> int:
    """Expert parameters a token does not run through: E - k experts of 3·h·F per MoE layer."""
    return len(z.moe_layers) * (z.experts - z.top_k) * 3 * z.h * z.moe_ffn


def _moe(z: _Sizes) -> str:
    if not z.moe_layers:
        return ""
    shared = f", a shared expert of {z.shared_ffn}" if z.shared_ffn else ""
    layers = ",".join(map(str, z.moe_layers))
    return f"top {z.top_k} of {z.experts} experts of {z.moe_ffn}{shared} in layers {layers}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _notes(z: _Sizes) -> list[str]:
    notes = []
    if not spec_named(z.family).llama_activations:
        notes.append(f"activations: {z.family}'s layers are counted with Llama's table "
                     "(plan/activations.py), an estimate for them")  # fmt: skip
    if z.fsdp and z.pp > 1:
        notes.append("FSDP under a pipeline schedule keeps gradients unsharded (and zero1 the "
                     "parameters gathered) until the step's last backward")  # fmt: skip
    if z.mode == "full" and z.pp > 1:
        notes.append(
            "full_shard with pp > 1: the dp all-gather count is a bound (2 per microbatch)"
        )
    if z.autocast:
        notes.append("autocast keeps a cast copy of each linear weight for the step")
    if z.moe_layers and z.ep == 1:
        notes.append("moe: no expert parallelism (every rank holds every expert; their "
                     "gradients are in the dp reduction above)")  # fmt: skip
    if z.ep > 1:
        local = z.experts // z.ep
        if z.dispatcher == "allgather":
            tail = ("the ep all-gathers and reduce-scatters carry every rank's T tokens whatever "
                    "the routing; the activations count k·T rows run by the local experts: "
                    "balanced routing assumed (the real count depends on the routing)")  # fmt: skip
        else:
            tail = ("the ep all-to-alls carry k·T rows each way on average and the activations "
                    "count k·T received rows: balanced routing assumed (the real split, so the "
                    "bytes received, sent back and saved, depends on the routing)")  # fmt: skip
        notes.append(
            f"moe: expert parallelism {z.ep} ({z.dispatcher}): each rank holds {local} of the "
            f"{z.experts} experts of every MoE layer; {tail}"
        )
    if z.moe_layers and z.tp > 1:
        notes.append("moe: the tp items count the dense MLP's collectives in MoE layers too "
                     "(the block runs replicated, without them: a bound)")  # fmt: skip
    if z.moe_layers and z.autocast:
        notes.append("moe: the experts' saved bytes count a cast of every (local) expert's "
                     "weights per microbatch (a bound: exact when every expert gets a token)")  # fmt: skip
    return notes
