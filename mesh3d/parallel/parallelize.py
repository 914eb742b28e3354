"""Turn a single-device model into its parallel form on the ("pp", "dp", "cp", "tp") mesh.

Order: 1. tensor (and context) parallelism on meta; 2. activation checkpointing and
`torch.compile`; 3. materialize, filling each *full* parameter and keeping this rank's shard, so
the full weights are the same at every layout; 4. data parallelism on the replica mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mesh3d import extensions
from mesh3d.mesh import hsdp_mesh, replica_mesh
from mesh3d.models.init import init_full_tensor
from mesh3d.models.spec import Blocks
from mesh3d.torch_private import checkpoint_wrapper

if TYPE_CHECKING:
    from mesh3d.tp_styles import TPPlan


# selective recompute keeps these ops' outputs (matmuls, attention) and recomputes the rest
_KEPT_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(model: nn.Module, mode: str = "full", every: int = 1) -> None:
    """Wrap decoder layers (those whose index is a multiple of `every`) in activation
    checkpointing: `full` keeps only the layer's input, `selective` keeps `_KEPT_OPS` too."""
    selective = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    extra = {"context_fn": selective} if mode == "selective" else {}
    for key, layer in list(model.layers.items()):
        if layer is not None and int(key) % every == 0:
            model.layers[key] = checkpoint_wrapper(layer, preserve_rng_state=False, **extra)


FullSource = Callable[[str, tuple[int, ...]], torch.Tensor]


def seeded_init(
    std_of: Callable[[str], float | None], seed: int, valid_rows: dict[str, int] | None = None
) -> FullSource:
    """Full initial tensors, each drawn from its own seed (the parameter's name); rows past
    `valid_rows[name]` (vocabulary padding, which depends on tp) are zeros."""
    valid_rows = valid_rows or {}

    def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        rows = min(valid_rows.get(name, shape[0]), shape[0])
        out = torch.zeros(shape)
        out[:rows] = init_full_tensor(name, (rows, *shape[1:]), std_of(name), seed)
        return out

    return full


def materialize(model: nn.Module, device: torch.device, source: FullSource | None) -> None:
    """Allocate `model` on `device` and fill every parameter from `source(name, full_shape)`,
    keeping this rank's shard by local slicing. On `meta`, `source` is not called."""
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if device.type == "meta":
        return
    tied = getattr(model, "tied_parameters", {})
    experts = {  # module name -> its ep shard (group, rank, size)
        canonical_name(n): m.ep_shard
        for n, m in model.named_modules()
        if getattr(m, "ep_shard", None) is not None
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = tied.get(canonical_name(name), canonical_name(name))
            shard = experts.get(name.rsplit(".", 1)[0])
            if shard is None:
                full = source(name, tuple(p.shape))
            else:  # an ep slice of the full [E, ...] tensor
                full = extensions.load("expert_parallel").slice_expert_shard(
                    source(name, (p.shape[0] * shard[2], *p.shape[1:])), shard
                )
            full = full.to(device=device, dtype=torch.float32)
            if isinstance(p, DTensor):
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(full)


def mark_expert_shards(model: nn.Module) -> None:
    """Tag the final expert parameters with their shard (`expert_shard`)."""
    for module in model.modules():
        if getattr(module, "ep_shard", None) is not None:
            for p in module.parameters(recurse=False):
                p.expert_shard = module.ep_shard


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (activation-checkpoint wrappers removed)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def parallelize(model: nn.Module, mesh: DeviceMesh, *, device: torch.device,
                source: FullSource | None, tp_plan: TPPlan, recompute_layer: bool, dp: str,
                recompute: str = "full", recompute_every: int = 1,
                dtype: torch.dtype = torch.float32, compile_classes: tuple[type, ...] = (),
                split_backward: bool = False, documents: bool = False, ep=None,
                blocks: Blocks | None = None, lora=None,
                dp_shard: int | None = None) -> nn.Module:  # fmt: skip
    """Steps 1-4 above on a model built on meta; returns the model ready to train.

    `tp_plan`, `compile_classes` and `blocks` come from the model family's spec; `ep`: an
    `experts.ExpertParallel` (ep > 1); `lora`: a `models/lora.py::LoraPlan` (adapters added
    after tp, `source` gives them too, only they train); `dp_shard`: HSDP groups of this many
    dp ranks."""
    if ep is not None and ep.size > 1:  # before tp: the expert stacks shrink to their slice
        extensions.load("expert_parallel").apply_ep(model, ep, blocks.moe)
    if mesh["tp"].size() > 1:  # tensor parallelism's code is loaded only here
        from mesh3d.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], tp_plan, strict=False)  # a family's plan, every variant
    if lora is not None:  # split like the projections tp split just now
        extensions.load("lora").inject(model, lora, mesh["tp"])
    if "cp" in mesh.mesh_dim_names and mesh["cp"].size() > 1:
        extensions.load("context_parallel").apply_cp(model, mesh["cp"], documents, blocks)
    if recompute_layer:
        checkpoint_layers(model, recompute, recompute_every)
    if compile_classes:
        from mesh3d.parallel.compile import compile_blocks

        compile_blocks(model, compile_classes, mesh, split_backward)
    materialize(model, device, source)
    model.to(dtype)
    if mesh["tp"].size() > 1:
        from mesh3d.parallel.tensor import shard_grads_like_params

        shard_grads_like_params(model)  # after materialize / to(): they may swap parameters
    if lora is not None:  # before DP: FSDP and the optimizer see what trains
        extensions.load("lora").freeze_base(model)
    replicas = replica_mesh(mesh)
    if replicas.size() > 1:
        from mesh3d.parallel.fsdp import apply_dp

        apply_dp(model, hsdp_mesh(mesh, dp_shard) if dp_shard else replicas, dp)
    mark_expert_shards(model)
    return model
