"""Checks of a `moe_config` and of expert parallelism; part of `validate` (same rules: one
message per problem naming the key, the values and the fix; no torch import)."""

from __future__ import annotations

from collections.abc import Iterator

from mesh3d.config.schema import Config

MC = "model.model_config"


def moe_errors(cfg: Config, mc) -> Iterator[str]:
    """`moe_config`: its values."""
    moe, key = mc.moe_config, f"{MC}.moe_config"
    name = {k: f"{key}.{k}" for k in ("num_experts", "top_k", "moe_intermediate_size")}
    name.update(getattr(moe, "names", {}))  # a family that keeps these keys elsewhere (LlaMoE)
    for k in ("num_experts", "top_k", "moe_intermediate_size"):
        if getattr(moe, k) < 1:
            yield f"`{name[k]}` must be >= 1, got {getattr(moe, k)}"
    if 1 <= moe.num_experts < moe.top_k:
        yield (f"`{name['top_k']}` ({moe.top_k}) must be at most {name['num_experts'].rsplit('.')[-1]} "
               f"({moe.num_experts})")  # fmt: skip
    if moe.enable_shared_expert and moe.shared_expert_intermediate_size < 1:
        yield (f"`{key}.shared_expert_intermediate_size` must be >= 1 with enable_shared_expert, "
               f"got {moe.shared_expert_intermediate_size}")  # fmt: skip
    if moe.router_aux_loss_coef < 0:
        yield f"`{key}.router_aux_loss_coef` must be >= 0, got {moe.router_aux_loss_coef}"
    if moe.token_dispatcher_type not in ("alltoall", "allgather"):
        yield f"`{key}.token_dispatcher_type` {moe.token_dispatcher_type!r} must be alltoall or allgather"
    n = mc.num_hidden_layers
    if list(moe.layers) != [-1] and any(not 0 <= i < n for i in moe.layers):
        yield f"`{key}.layers` {list(moe.layers)} must be [-1] (every layer) or layer indices in 0..{n - 1}"


def expert_parallel_errors(cfg: Config) -> Iterator[str]:
    """`parallelism.expert_parallel_size`: the experts split over that many dp ranks."""
    p, ep = cfg.parallelism, cfg.parallelism.expert_parallel_size
    if ep <= 1 or cfg.mesh3d.hf_model:  # (a transformers model's: config/hf_model.py)
        return
    key = "parallelism.expert_parallel_size"
    moe = getattr(cfg.model.model_config, "moe_config", None)
    if moe is None:
        yield f"`{key}` is {ep}, but the model has no experts (no moe_config); set it to 1"
        return
    if p.dp % ep:
        yield (f"`{key}` ({ep}) must divide `parallelism.dp` ({p.dp}): the experts are split over "
               "dp ranks (mesh3d, like Nanotron, does not count ep in the world size)")  # fmt: skip
    if moe.num_experts % ep:
        experts = getattr(moe, "names", {}).get("num_experts", f"{MC}.moe_config.num_experts")
        yield f"`{experts}` ({moe.num_experts}) must be divisible by `{key}` ({ep})"
