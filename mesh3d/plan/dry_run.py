"""`mesh3d plan --dry-run`: build every distinct rank's model parts as training does, on one CPU.

For each representative rank, torch's fake process group (`backend="fake"`: every collective
returns at once, no data moves) is started as that rank of the whole world, and the rank runs
training's own construction: `RunLayout.resolve`, `build_mesh`, `build_model_parts` (meta model,
stage split, TP plan as DTensors, context and expert parallelism, activation checkpointing,
FSDP2 for zero 1 / full shard, the `PipelineStage`s and the schedule) and `build_optimizer`,
with `device=meta`: shapes only, no memory. AdamW's state is created lazily, so one optimizer
step runs on zero meta gradients laid out like the parameters. The group is then destroyed and
the next representative starts its own: a mesh takes its coordinates from the default group's
rank, so training's `build_mesh` (`init_device_mesh`) and the ep groups' `new_group` calls run
unchanged (at 4,096 ranks a group and its mesh take ~0.07 s). The mesh is a "cpu" one whatever
`mesh3d.device` says: the device type changes no shape, and no GPU is needed.

Representatives. A rank's parameter shapes are fixed by
- its pp coordinate: which stages it runs (layers, embedding, head, tied copies);
- its tp coordinate, through `torch.chunk` of each dim the TP plan shards (DTensor `Shard`);
- its index in the flattened dp x cp group, through FSDP2's `torch.chunk` of each tp-local
  dim 0 over dp x cp (zero 1 / full shard only; expert slices and replicated runs do not
  depend on it).
Nothing else changes a shape: cp ranks hold the same parameters and sequence shards of one
length (validate requires S divisible by 2·cp); ep ranks hold E / ep experts each (validate
requires E divisible by ep); the pipeline stages' input and output shapes depend on the stage
only. So ranks are grouped by pp coordinate and the local size of every parameter as the plan
computes it for them (`_params`, the chunk arithmetic above), and the lowest rank of each group
is built. With even shards that is one rank per pp coordinate; uneven ones add the ranks holding
a shorter or an empty chunk (a padded vocab over 64 dp ranks; 60 router rows over 16). Should
the plan model a shard wrongly, the representative's own bytes show it, but for the degenerate
case where its chunk is the whole dim (one row over tp, say) and only the other ranks' differ.

What is compared: parameters and optimizer state are the local tensors the rank holds
(`to_local()` of DTensors and FSDP2's sharded parameters, the plain expert slices, AdamW's
`exp_avg`, `exp_avg_sq` and `step`); gradients are the zero gradients given to the step, laid out
as training's are at the step (like their parameter: FSDP2, `shard_grads_like_params`). No
forward or backward runs: activations, communication and the schedule's run need real data.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mesh3d.errors import UserError
from mesh3d.layout import RunLayout
from mesh3d.mesh import ParallelDims, build_mesh, hsdp_mesh, replica_mesh
from mesh3d.parallel.pipeline_layout import stage_ids_of_rank
from mesh3d.plan.build import stage_shapes
from mesh3d.plan.memory import _params
from mesh3d.plan.records import BuiltRank, DryRun, Plan
from mesh3d.plan.report import _ranges
from mesh3d.plan.sizes import _Sizes
from mesh3d.torch_private import fake_store

TOLERANCE = 1e-6  # relative (16 KiB of 16 GiB); the plan has been exact, which the tests demand
PACKAGE = str(Path(__file__).resolve().parents[1])  # mesh3d/: its frames name the failing part

# mesh3d's construction steps (function names in a traceback), named for the error message
PARTS = {
    "build_mesh": "the device mesh",
    "build": "the model (its family's spec.build)",
    "new_groups": "the expert-parallel groups",
    "apply_ep": "expert parallelism (apply_ep)",
    "apply_tp": "tensor parallelism, the TP plan (apply_tp)",
    "apply_cp": "context parallelism (apply_cp)",
    "checkpoint_layers": "activation checkpointing (checkpoint_layers)",
    "compile_blocks": "torch.compile of the blocks (compile_blocks)",
    "materialize": "materializing the parameters (materialize)",
    "apply_dp": "FSDP2 / zero on the dp x cp mesh (apply_dp)",
    "build_stage": "the pipeline stage split (build_stage)",
    "pipeline_stage": "the PipelineStage (pipeline_stage)",
    "build_schedule": "the pipeline schedule (build_schedule)",
    "parallelize": "parallelizing a model part (parallelize)",
    "build_model_parts": "the model parts (build_model_parts)",
    "build_optimizer": "the optimizer (build_optimizer)",
    "_optimizer_state": "the optimizer state (a step on meta)",
}


class DryRunError(UserError):
    """A rank's model parts could not be built: the message names the rank, layout and part."""


def representatives(cfg, world_size: int) -> dict[int, list[int]]:
    """{representative rank: the ranks holding parameters of its local shapes}, ranks ascending
    (see the module doc for why these)."""
    z = _Sizes.of(cfg)
    dims = ParallelDims(dp=z.dp, tp=z.tp, pp=z.pp, cp=z.cp)
    dims.validate(world_size)
    _, _, shapes = stage_shapes(cfg, z)
    groups: dict[tuple, list[int]] = {}
    for rank in range(world_size):
        c = dims.coords(rank)
        ids = stage_ids_of_rank(c["pp"], z.pp, z.v, z.schedule) if z.pp > 1 else [0]
        local = tuple(x.local for i in ids for x in _params(z, shapes[i], c))
        groups.setdefault((c["pp"], local), []).append(rank)
    return {ranks[0]: ranks for ranks in groups.values()}


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as `rank` of `world_size` on torch's fake process group, for the block."""
    store = fake_store()  # registers "fake"
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        replica_mesh.cache_clear()  # keyed by mesh equality: the next rank's mesh is "equal"
        hsdp_mesh.cache_clear()


def _local_bytes(tensors) -> tuple[int, int]:
    """(elements, bytes) of the local shards of `tensors`."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() for t in local), sum(t.numel() * t.element_size() for t in local)


def _optimizer_state(optimizer: torch.optim.Optimizer, params: list) -> list[torch.Tensor]:
    """The optimizer's state tensors after one step on zero gradients shaped like `params` (those
    that train: a frozen base weight under LoRA gets none)."""
    for p in params:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def build_rank(cfg, world_size: int, rank: int, ranks: list[int]) -> BuiltRank:
    """Build `rank`'s parts as training does (in a fake world of `world_size`) and measure them;
    a failure is a `DryRunError` naming the rank, the layout and the failing part."""
    from mesh3d.train.build import build_model_parts  # the training stack, loaded on use
    from mesh3d.train.optim import build_optimizer

    start, meta = time.perf_counter(), torch.device("meta")
    layout = RunLayout.resolve(cfg, world_size, rank)
    try:
        with fake_world(rank, world_size):
            mesh = build_mesh(layout.dims, "cpu")
            parts = build_model_parts(cfg, layout, mesh, meta)
            optimizer, _ = build_optimizer(parts.named_parameters(), cfg, layout, meta)
            params = parts.parameters()
            state = _optimizer_state(optimizer, params)
    except Exception as e:
        raise DryRunError(_failure(e, layout, world_size)) from e
    elements, param_bytes = _local_bytes(params)
    return BuiltRank(
        rank=rank, ranks=ranks, coords=layout.coords,
        stages=[s.stage_index for s in parts.stages] or [0], param_elements=elements,
        param_bytes=param_bytes, grad_bytes=_local_bytes(p.grad for p in params if p.grad is not None)[1],
        optimizer_bytes=_local_bytes(state)[1],
        schedule=type(parts.schedule).__name__ if parts.schedule is not None else "",
        seconds=time.perf_counter() - start,
    )  # fmt: skip


def _failure(e: Exception, layout: RunLayout, world_size: int) -> str:
    """'dry run: rank R (pp .., dp .., cp .., tp ..) of N (layout) failed building PART: ...'."""
    frames = reversed(traceback.extract_tb(e.__traceback__))  # innermost first
    names = [f.name for f in frames if f.filename.startswith(PACKAGE)]
    part = next((PARTS[n] for n in names if n in PARTS), f"its parts ({names[0]})")
    where = ", ".join(f"{a} {v}" for a, v in layout.coords.items())
    d = layout.dims
    grid = f"pp {d.pp} x dp {d.dp} x cp {d.cp} x tp {d.tp}"
    ep = f", ep {layout.expert_parallel}" if layout.expert_parallel > 1 else ""
    return (
        f"dry run: rank {layout.rank} ({where}) of {world_size} ({grid}{ep}, dp mode "
        f"{layout.dp_mode}, schedule {layout.schedule or 'none'}) failed building {part}: "
        f"{type(e).__name__}: {e}"
    )


def dry_run(cfg, world_size: int) -> DryRun:
    """Build each representative rank of `cfg` on `world_size` processes (a validated config)."""
    if dist.is_initialized():
        raise RuntimeError("a dry run starts its own process groups; this process has one")
    start = time.perf_counter()
    built = [
        build_rank(cfg, world_size, r, rs) for r, rs in representatives(cfg, world_size).items()
    ]
    return DryRun(world_size, built, time.perf_counter() - start)


def differences(plan: Plan, run: DryRun) -> dict[int, list[str]]:
    """{representative rank: ['what: built B, plan P for ranks R', ...]} wherever the plan's bytes
    for a rank it stands for differ from what it holds by more than TOLERANCE."""
    out: dict[int, list[str]] = {}
    for b in run.built:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            got, off = getattr(b, key), {}
            for rank in b.ranks:
                want = getattr(plan.ranks[rank], key)
                if abs(got - want) > TOLERANCE * max(want, 1):
                    off.setdefault(want, []).append(rank)
            out.setdefault(b.rank, []).extend(
                f"{key}: built {got:,}, plan {want:,} for ranks {_ranges(ranks)}"
                for want, ranks in off.items()
            )
    return {rank: lines for rank, lines in out.items() if lines}
