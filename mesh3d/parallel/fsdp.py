"""FSDP2 (zero_stage 1 and full sharding, HSDP) over the dp mesh; loaded only at dp x cp > 1."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


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
