"""Turn a single-device model into its parallel form on the ("pp", "dp", "cp", "tp") mesh.

Order: 1. tensor (and context) parallelism on meta; 2. activation checkpointing and
`torch.compile`; 3. materialize, filling each *full* parameter and keeping this rank's shard, so
the full weights are the same at every layout; 4. data parallelism on the replica mesh.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from mesh3d import extensions
from mesh3d.mesh import hsdp_mesh, replica_mesh
from mesh3d.models.init import init_full_tensor
from mesh3d.models.spec import Blocks
from mesh3d.torch_private import (
    checkpoint_wrapper,
    compile_counters,
    disable_donated_buffer,
    inductor_cache_dir,
)

if TYPE_CHECKING:
    from mesh3d.tp_styles import TPPlan


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, documents: bool, blocks: Blocks) -> None:
    """Attention modules of `model` attend across the sequence shards of `cp_mesh`; MoE blocks
    sum their per-sequence load statistics over them."""
    from mesh3d.tp_styles import summed_over

    context = extensions.load("context_parallel")
    cp = context.ContextParallel(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(),
                                 documents)  # fmt: skip
    for module in model.modules():
        if isinstance(module, blocks.attention):
            module.cp = cp
        if isinstance(module, blocks.moe):  # its load statistics span the whole sequence
            module.sequence_sums.append(summed_over(cp.group))


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


def compile_blocks(model: nn.Module, kinds: tuple[type, ...], mesh: DeviceMesh | None = None,
                   split_backward: bool = False) -> None:  # fmt: skip
    """`torch.compile` in place each block of a kind in `kinds` inside each decoder layer.

    Not whole layers: a tensor-parallel layer fails in backward (docs/torch-notes.md). The
    two-pass backward of zero-bubble schedules (`split_backward`) needs no donated buffers."""
    if mesh is not None:
        private_compile_cache(mesh)
    if split_backward:
        disable_donated_buffer()
    for layer in model.layers.values():
        for module in layer.modules():
            if type(module) in kinds:  # exactly: not the shared expert (an MLP subclass)
                module.compile()


def private_compile_cache(mesh: DeviceMesh) -> str:
    """Point torch.compile's cache at a folder of this rank and layout; returns the folder.

    torch 2.13's AOTAutograd cache keys DTensor graphs without the rank but stores rank-specific
    code (pytorch/pytorch#188390). Must run before the first compile; idempotent."""
    layout = "-".join(f"{n}{k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    own = f"mesh3d-{layout}-rank{torch.distributed.get_rank()}"
    base = inductor_cache_dir()
    if os.path.basename(base).startswith("mesh3d-"):  # set before, by this function
        base = os.path.dirname(base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, own)
    return inductor_cache_dir()


def compile_notice() -> str:
    """Said before the first compiled step, which is silent for as long as compiling takes."""
    folder = inductor_cache_dir()
    return (
        "torch.compile (mesh3d.compile): the first step compiles the model's blocks, which "
        f"takes a while (tens of seconds); the graphs are cached in {folder} for next runs"
    )


def compile_cache_text() -> str:
    """What torch.compile did so far in this process: graphs compiled, and loaded from its cache."""
    aot, folder = compile_counters()["aot_autograd"], inductor_cache_dir()
    return (
        f"torch.compile: {aot['autograd_cache_hit']} graphs loaded from the cache in {folder}, "
        f"{aot['autograd_cache_miss']} compiled and saved, {aot['autograd_cache_bypass']} "
        "compiled and not cacheable"
    )


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


def apply_ep(model: nn.Module, ep, moe: tuple[type, ...]) -> None:
    """Every MoE block of `model` (on meta) keeps its ep rank's E / ep experts and dispatches
    tokens over `ep`; its expert stacks get `ep_shard` = (group, rank, size)."""
    for module in model.modules():
        if isinstance(module, moe):
            module.ep = ep
            ex = module.experts
            ex.ep_shard = (ep.group, ep.rank, ep.size)
            for pname, p in list(ex.named_parameters(recurse=False)):
                local = (p.shape[0] // ep.size, *p.shape[1:])
                ex.register_parameter(pname, nn.Parameter(torch.empty(local, device=p.device)))


def mark_expert_shards(model: nn.Module) -> None:
    """Tag the final expert parameters with their shard (`expert_shard`)."""
    for module in model.modules():
        if getattr(module, "ep_shard", None) is not None:
            for p in module.parameters(recurse=False):
                p.expert_shard = module.ep_shard


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (activation-checkpoint wrappers removed)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, mode: str, blocks: str = "layers") -> nn.Module:
    """FSDP2 over the dp mesh for 'zero1' / 'full' ('replicate': as is). Each block of
    `model.<blocks>` is its own FSDP unit. A 2-D ("dp_replicate", "dp_shard") mesh gives HSDP.

    Example:

        apply_dp(model, mesh["dp"], "zero1", blocks="h")
    """
    if mode == "replicate":
        return model
    if mode not in ("zero1", "full"):
        raise ValueError(f"unknown dp mode {mode!r}; use 'replicate', 'zero1' or 'full'")
    reshard = mode == "full"
    try:
        container = model.get_submodule(blocks)  # a dotted path works: "model.layers"
    except AttributeError:
        container = None
    units = container.values() if isinstance(container, nn.ModuleDict) else container or []
    # expert-parallel slices are not replicated over dp: FSDP leaves them to their own sum
    ignored = {p for m in model.modules() if getattr(m, "ep_shard", None) is not None
               for p in m.parameters(recurse=False)}  # fmt: skip
    for unit in [*units, model]:  # each block, then the root
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored)
    return model


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
        apply_ep(model, ep, blocks.moe)
    if mesh["tp"].size() > 1:  # tensor parallelism's code is loaded only here
        from mesh3d.parallel.tensor import apply_tp

        apply_tp(model, mesh["tp"], tp_plan, strict=False)  # a family's plan, every variant
    if lora is not None:  # split like the projections tp split just now
        extensions.load("lora").inject(model, lora, mesh["tp"])
    if "cp" in mesh.mesh_dim_names and mesh["cp"].size() > 1:
        apply_cp(model, mesh["cp"], documents, blocks)
    if recompute_layer:
        checkpoint_layers(model, recompute, recompute_every)
    if compile_classes:
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
        apply_dp(model, hsdp_mesh(mesh, dp_shard) if dp_shard else replicas, dp)
    mark_expert_shards(model)
    return model
