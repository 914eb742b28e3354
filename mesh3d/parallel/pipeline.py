"""Pipeline parallelism on the mesh's "pp" axis, with torch.distributed.pipelining.

Schedules always run with `scale_grads=False`: the loss is normalized in mesh3d/train/loss.py.
The layer split and stage placement live torch-free in `parallel/pipeline_layout.py`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import DTensor

from mesh3d.errors import ConfigError
from mesh3d.log import logger
from mesh3d.models.spec import tied_ends
from mesh3d.parallel import pipeline_layout as stage_math
from mesh3d.parallel.data import _local
from mesh3d.parallel.pipeline_layout import (
    rank_of_stage,
    split_by_cost,
    split_layers,
    stage_ids_of_rank,
)
from mesh3d.torch_private import pipeline_schedule_base

# the arithmetic lives in parallel/pipeline_layout.py (no torch); re-exported for callers
__all__ = [
    "SCHEDULES", "build_schedule", "build_stage", "is_multi_stage", "is_v_schedule",
    "pipeline_stage", "rank_of_stage", "run_schedule", "split_by_cost", "split_layers",
    "stage_ids_of_rank", "sync_tied_embeddings",
]  # fmt: skip

# a torch schedule (their common base class is private: `torch_private.pipeline_schedule_base`)
Schedule = torch_schedules.PipelineScheduleSingle | torch_schedules.PipelineScheduleMulti

# torch's schedule class for each name of the schedule table
SCHEDULES: dict[str, type[Schedule]] = {
    name: getattr(torch_schedules, traits.torch_class)
    for name, traits in stage_math.SCHEDULES.items()
}


def is_multi_stage(name: str) -> bool:
    """Whether schedule `name` runs a list of stages per rank (virtual stages, V schedules)."""
    return stage_math.schedule(name).multi_stage


def is_v_schedule(name: str) -> bool:
    """Whether `name` places exactly 2 stages per rank as a V (rank r: r and 2*pp-1-r)."""
    return stage_math.schedule(name).v_shape


def build_stage(model: nn.Module, stage_id: int, num_stages: int, layers: list[int], *,
                blocks: str = "layers", first: tuple[str, ...] = ("embed_tokens",),
                last: tuple[str, ...] = ("norm", "lm_head")) -> nn.Module:  # fmt: skip
    """A deep copy of `model` (meta or real) keeping only what stage `stage_id` owns.

    Blocks (a `ModuleDict` at `blocks`) not in `layers` are deleted; parameter names stay those
    of the full model. Modules in `first` / `last` stay on the first / last stage only, else are
    None (the forward must skip them). A tie with one end on the stage becomes its own parameter.

    Example:

        stage = build_stage(gpt, 1, 2, [2, 3], blocks="h", first=("wte", "wpe"), last=("ln_f", "head"))
    """
    bad = [f"first/last {v!r}: give a tuple of names" for v in (first, last) if isinstance(v, str)]
    names = [blocks, *(n for v in (first, last) for n in ((v,) if isinstance(v, str) else v))]
    bad += [f"{type(model).__name__} has no {n!r}" for n in names if not hasattr(model, n)]
    bad += [f"stage_id {stage_id} is not in 0..{num_stages - 1}"] * (not 0 <= stage_id < num_stages)
    if bad:
        raise ValueError(f"build_stage: {'; '.join(bad)}")
    container = getattr(model, blocks)
    if not isinstance(container, nn.ModuleDict):
        raise TypeError(
            f"`{blocks}` of {type(model).__name__} is a {type(container).__name__}; pipeline "
            "stages need the blocks in an nn.ModuleDict (keys '0', '1', ...)"
        )
    keep = {str(i) for i in layers}
    missing = keep - set(container.keys())
    if missing:
        raise ValueError(f"layers {sorted(missing)} are not among `{blocks}` {list(container)}")
    gone = [*(first if stage_id != 0 else ()), *(last if stage_id != num_stages - 1 else ())]
    dropped = [m for key, m in container.items() if key not in keep]
    dropped += [getattr(model, n) for n in gone]
    # dropped modules are copied as None (so only the kept layers are copied)
    stage = copy.deepcopy(model, memo={id(m): None for m in dropped if m is not None})
    container = getattr(stage, blocks)
    for key in list(container.keys()):
        if key not in keep:
            del container[key]
    for name in gone:
        setattr(stage, name, None)
    return stage


def pipeline_stage(module: nn.Module, stage_id: int, num_stages: int, device: torch.device,
                   pp_group: dist.ProcessGroup | None, *, microbatch_size: int, seq_len: int,
                   seq_len_local: int, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                   logits_dtype: torch.dtype | None = None) -> PipelineStage:  # fmt: skip
    """A `PipelineStage` for `module` with its exact per-microbatch shapes, as meta tensors.

    Hidden states carry requires_grad=True: torch 2.13 derives from it whether a stage sends
    gradients."""

    def meta(*shape: int, dtype: torch.dtype = dtype, grad: bool = True) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)

    mbs, hidden = microbatch_size, (microbatch_size, seq_len_local, hidden_size)
    ids = meta(mbs, seq_len, dtype=torch.int64, grad=False)
    logits = meta(mbs, seq_len, vocab_size, dtype=logits_dtype or dtype)
    inputs = ids if stage_id == 0 else meta(*hidden)
    outputs = logits if stage_id == num_stages - 1 else meta(*hidden)
    io = {"input_args": (inputs,), "output_args": (outputs,)}
    return PipelineStage(module, stage_id, num_stages, device, group=pp_group, **io)


def build_schedule(
    name: str, stages: list[PipelineStage], n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Schedule:  # fmt: skip
    """The schedule called `name` over this rank's `stages`, with `scale_grads=False`.

    `loss_fn(logits, labels)` must return one microbatch's share of the normalized step loss.

    Example:

        stage = PipelineStage(module, pp_rank, pp, device, group=mesh["pp"].get_group(),
                              input_args=(example_in,), output_args=(example_out,))
        schedule = mesh3d.build_schedule("1f1b", [stage], microbatches, loss_fn)
    """
    cls = SCHEDULES[stage_math.schedule(name).name]
    if name == "1f1b" and stages and n_microbatches < stages[0].num_stages:
        # torch's Schedule1F1B needs n >= pp; Nanotron's 1F1B at n = pp - 1 runs in GPipe's
        # order (same losses and gradient sums), so run GPipe
        logger.info(
            f"1F1B with {n_microbatches} microbatches < pp {stages[0].num_stages} runs as "
            "all-forward-all-backward, which is what Nanotron's 1F1B does"
        )
        cls = ScheduleGPipe
    if is_multi_stage(name):
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ConfigError(
            f"the {name} schedule runs one stage per rank, got {len(stages)}; set "
            "`mesh3d.pp_virtual_stages` to 1 or pick a multi-stage schedule"
        )
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


_HAS_RETURN_OUTPUTS = (
    "return_outputs" in inspect.signature(pipeline_schedule_base().step).parameters
)


def run_schedule(schedule: Schedule, stages: list[PipelineStage], inputs: torch.Tensor | None,
                 labels: torch.Tensor | None, positions: torch.Tensor | None = None,
                 forward_only: bool = False,
                 token_keys: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
    """One step of forward/backward over all microbatches; the per-microbatch losses.

    `inputs`, `labels`, `positions` and `token_keys` [n·mbs, S] are split into n microbatches.
    Returns the detached losses where this rank runs the last stage, else []. `forward_only`
    runs the schedule's `eval()`; call it under `torch.no_grad()`.

    Example:

        losses = mesh3d.run_schedule(schedule, [stage], input_ids, labels)   # [] off the last stage
    """
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    assert not first or inputs is not None, "the rank with stage 0 needs the input ids"
    assert not last or labels is not None, "the rank with the last stage needs the labels"
    losses: list[torch.Tensor] = []
    kwargs = {"return_outputs": False} if _HAS_RETURN_OUTPUTS else {}
    args = (inputs,) if first else ()
    for key, value in (("positions", positions), ("token_keys", token_keys)):
        if value is not None:
            kwargs[key] = value
    run = schedule.eval if forward_only else schedule.step
    run(*args, target=labels if last else None, losses=losses, **kwargs)
    return [loss.detach() for loss in losses] if last else []


@torch.no_grad()
def sync_tied_embeddings(stage_modules: list[nn.Module], pp_group: dist.ProcessGroup | None,
                         embed_rank: int, head_rank: int) -> None:  # fmt: skip
    """Sum the embedding and lm_head gradients of a tied model split over stages.

    Call on every pp rank after dp reduction, before clipping. Across two ranks (`embed_rank`,
    `head_rank` in `pp_group`) the shards are exchanged; addition commutes, so both agree bitwise.
    """
    ends = [e for e in map(tied_ends, stage_modules) if e is not None]
    embed = next((e for e, _ in ends if e is not None), None)
    head = next((h for _, h in ends if h is not None), None)
    if embed is not None and head is not None:
        if embed.weight is not head.weight:
            ge, gh = _grad_shard(embed.weight), _grad_shard(head.weight)
            ge.add_(gh)
            gh.copy_(ge)
        return
    if embed is None and head is None:
        return
    mine = _grad_shard(embed.weight if embed is not None else head.weight)
    group = dist.group.WORLD if pp_group is None else pp_group
    peer = dist.get_global_rank(group, head_rank if embed is not None else embed_rank)
    theirs = torch.empty_like(mine)
    ops = [
        dist.P2POp(dist.isend, mine, peer, group=group),
        dist.P2POp(dist.irecv, theirs, peer, group=group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    mine.add_(theirs)


def _grad_shard(param: nn.Parameter) -> torch.Tensor:
    """`param.grad`, re-laid out like `param` in place, as a local tensor (the vocab-parallel
    embedding's gradient comes back `Replicate()` while its weight is `Shard(0)`)."""
    assert param.grad is not None, "sync_tied_embeddings runs after backward"
    if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)
    return _local(param.grad)
