"""Expert parallelism for a `transformers` MoE model: its stacked experts split over ep ranks.

transformers keeps the experts of an MoE layer as stacked tensors in one module (Mixtral and
the models built like it: `gate_up_proj` [E, 2F, h], `down_proj` [E, h, F], `act_fn`, called as
`experts(hidden [T, h], top_k_index [T, k], top_k_weights [T, k])`). Under ep > 1 each rank keeps
its E / ep experts (plain tensors marked `expert_shard`, as mesh3d's own MoE layers: checkpoints
gather them whole, FSDP leaves them out, their gradients sum over the ranks holding the same
experts) and the module's forward sends each token to the rank holding its expert and back
(`parallel/experts.py`, the dispatch of mesh3d's own MoE layers). The router stays the model's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.errors import UserError


def stacked_experts(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` holding stacked experts in the form above."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
        and isinstance(getattr(m, "down_proj", None), nn.Parameter)
        and m.gate_up_proj.dim() == 3
        and hasattr(m, "act_fn")
    ]


def apply_ep(model: nn.Module, ep) -> None:
    """Split `model`'s stacked experts over `ep` (a `parallel.experts.ExpertParallel`), in place."""
    found = stacked_experts(model)
    name = type(model).__name__
    if not found:
        raise UserError(
            f"ep: {name} has no MoE experts in the form mesh3d splits (stacked gate_up_proj / "
            "down_proj); set parallelism.expert_parallel_size to 1"
        )
    for m in found:
        experts = m.gate_up_proj.shape[0]
        if experts % ep.size:
            raise UserError(f"ep: {name} has {experts} experts, not divisible by ep={ep.size}")
        n, shard = experts // ep.size, (ep.group, ep.rank, ep.size)
        for key in ("gate_up_proj", "down_proj"):
            full = getattr(m, key)
            local = nn.Parameter(full.detach()[ep.rank * n : (ep.rank + 1) * n].clone())
            local.expert_shard = shard
            setattr(m, key, local)
        m.ep_shard, m.mesh3d_ep, m.mesh3d_experts = shard, ep, experts
        m.forward = types.MethodType(_forward, m)


def _forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Σ over each token's k experts of weight · expert(token), the experts on their ranks."""

    def run(rows: Tensor, counts: Tensor) -> Tensor:  # rows grouped by this rank's experts
        outs = []
        for e, part in enumerate(rows.split(counts.tolist())):
            gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else rows

    return self.mesh3d_ep.dispatch(run, hidden, top_k_index, top_k_weights, self.mesh3d_experts)
