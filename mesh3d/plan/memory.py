"""Parameters as one rank holds them, and the bytes alive during part of a step.

Bytes per rank (tests/ranks/test_plan_ranks.py compares params, grads and optimizer state with a real 2x2x2
run, exactly):
- params: local elements x param dtype (fp32 under `accumulate_grad_in_fp32`: master weights).
  TP splits a dim like `torch.chunk`; FSDP2 (zero_stage 1 or full_shard, dp x cp > 1) then
  chunks dim 0 of the tp-local tensor over the flattened dp x cp group (cp ranks hold the same
  parameters, like dp ranks): ceil(rows / (dp·cp)) each, the last ranks get what is left;
  under expert parallelism (ep > 1) the stacked expert weights [E, ...] hold the rank's
  E / ep experts (`parallel/experts.py`), which FSDP leaves whole (`ignored_params`: they are
  not replicated over dp x cp);
- grads, at the optimizer step: as the params (sharded like them: `shard_grads_like_params`);
- optimizer: AdamW exp_avg + exp_avg_sq in the param dtype and a 4-byte `step` per parameter;
  SGD (no momentum in mesh3d) none.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mesh3d.models.registry import spec_named
from mesh3d.parallel.buckets import buffer_bytes
from mesh3d.plan.sizes import _Sizes


@dataclass
class _Param:
    """One parameter as one rank holds it, in elements."""

    name: str
    local: int  # the rank's shard
    tp_local: int  # before dp sharding
    gathered: int  # what FSDP all-gathers: dp x cp x the ceil-sized shard (0: an expert slice)
    grad: int  # the gradient at the optimizer step (0 for a frozen weight)
    matmul: bool  # a linear weight: autocast keeps a cast copy
    expert: bool = False  # an expert-parallel slice: E / ep of the experts, reduced apart
    trains: bool = True  # False: frozen under LoRA (its `grad` is 0, no optimizer state)


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
                if name.endswith(".bias"):  # a row-parallel linear's bias is replicated
                    return None
                return 0 if emb else 1
    return None


@dataclass(frozen=True)
class _Shape:
    """One parameter of a stage module before a rank's coordinates pick its shard."""

    name: str
    shape: tuple[int, ...]  # under expert parallelism: the ep slice of the stacked experts
    tp_dim: int | None  # the dim the TP plan shards; None: replicated over tp
    matmul: bool  # a linear weight: autocast keeps a cast copy
    expert: bool
    trains: bool = True  # False: a base weight LoRA freezes (no gradient, no optimizer state)


def _shapes(z: _Sizes, module: nn.Module, lora=None) -> list[_Shape]:
    """Every parameter of one meta stage module, once for all the ranks that run it (matching
    the TP plan's patterns per rank took 90% of a plan at 4,096 ranks). With `lora` (a
    `LoraPlan`; the module holds its adapters) only the adapters train."""
    plan = spec_named(z.family).tp_plan(z.sp) if z.tp > 1 else {}
    head = getattr(module, "lm_head", None)
    out = []
    for name, param in module.named_parameters():  # a tied head shares the embedding's
        shape = list(param.shape)
        if lora is not None and (".lora_A." in name or ".lora_B." in name):
            kind = lora.adapter_kind(name)
            tp_dim = {"column": 0, "row": 1}.get(kind) if z.tp > 1 else None
            out.append(_Shape(name, tuple(shape), tp_dim, True, False))
            continue
        expert = z.ep > 1 and ".experts.merged_" in name
        if expert:  # the meta model holds every expert; the rank its ep slice
            shape[0] //= z.ep
        # (the shared-expert gate is a leaf linear weight too; the router is not cast: it runs
        # in fp32 outside autocast; the experts' stacked weights are not cast whole: each
        # expert's slice is cast when it runs, see activations)
        matmul = name.endswith(("proj.weight", "shared_expert_gate.weight"))
        matmul |= name == "lm_head.weight"
        matmul |= head is not None and param is head.weight
        tp_dim = _tp_dim(module, name, plan)
        out.append(_Shape(name, tuple(shape), tp_dim, matmul, expert, trains=lora is None))
    return out


def _params(z: _Sizes, shapes: list[_Shape], coords: dict[str, int]) -> list[_Param]:
    """Every parameter of one stage module (its `_shapes`) as the rank at `coords` holds it."""
    out = []
    for s in shapes:
        shape = list(s.shape)
        if s.tp_dim is not None:
            shape[s.tp_dim] = _chunk(shape[s.tp_dim], z.tp, coords["tp"])
        row = math.prod(shape[1:])
        local = tp_local = gathered = row * shape[0]
        if z.fsdp and s.expert:  # FSDP leaves expert slices alone
            gathered = 0
        elif z.fsdp:  # over the shard group: dp x cp, or HSDP's dp_shard x cp
            local = _chunk(shape[0], z.shards, z.shard_index(coords)) * row
            gathered = -(-shape[0] // z.shards) * z.shards * row
        grad = local if s.trains else 0
        out.append(_Param(s.name, local, tp_local, gathered, grad, s.matmul, s.expert, s.trains))
    return out


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
            out["fsdp_unsharded_grads"] = (
                sum(p.tp_local for p in params if not p.expert and p.trains) * z.e_p
            )
    if z.mode == "replicate" and z.replicas > 1:  # zero_stage 0: parallel/buckets.py
        sizes = [p.tp_local * z.e_p for p in params if not p.expert and p.trains]
        out["dp_grad_buckets"] = buffer_bytes(sizes, z.bucket_cap)
    if z.autocast:
        out["autocast_weight_copies"] = sum(p.tp_local for p in params if p.matmul) * z.e_c
    if z.recompute:
        out["recomputed_layer"] = one_layer
    if z.pp > 1:  # a receive buffer per microbatch, stage input and output gradient
        last = z.pp * z.v - 1
        n = sum((s != 0) + (s != last) for s in stages) * z.m
        out["pp_recv_buffers"] = n * z.local_tokens * z.h * z.e_p
    return {k: b for k, b in out.items() if b}
