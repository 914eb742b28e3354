"""Mixture-of-experts block (Nanotron's Qwen2 `moe_config`), torch only.

What replaces the MLP of an MoE layer:
- a router: logits = x · Wᵀ in fp32 (W [E, h], kept in fp32 like Nanotron's and HF's), softmax
  over the E experts, the top-k probabilities taken as the weights: as they are (Nanotron's
  Qwen2 and HF's Qwen2-MoE default), or with `norm_topk_prob` divided by their sum, so each
  token's k weights add up to 1 (HF's `norm_topk_prob: true`, what Qwen3-MoE models set);
- E experts, each down(act(gate(x)) * up(x)) with `moe_intermediate_size` F, stored as
  Nanotron stores them: `merged_gate_up_proj` [E, h, 2F] (gate columns first) and
  `merged_down_proj` [E, F, h], applied as x @ W (not x @ Wᵀ);
- dropless dispatch: every token reaches its k experts, however unbalanced; the (token, slot)
  pairs are sorted by expert, every expert runs on its rows (two grouped GEMMs, or a loop over
  the experts where `torch._grouped_mm` is not available), and the weighted results are added
  back to their tokens;
- optionally a shared expert (a plain MLP of `shared_expert_intermediate_size`) whose output is
  gated per token by sigmoid(x · g), g [1, h] (`shared_expert_gate`).

Load balancing. The auxiliary loss is the Switch-Transformer one, E · Σₑ fₑ · Pₑ (fₑ: the
share of the k·T routed slots that chose expert e, Pₑ: the mean router probability of e), taken
per sequence and summed over the sequences of a microbatch. Per sequence, not per microbatch:
a sequence is the unit every layout keeps whole, so the loss and its gradient are the same at
any dp, pp or microbatch split. It does not pass through the logits: `attach_aux` adds its
gradient (times `aux_weight`) in backward, the way the loss would, so it works on every
pipeline stage without a second output. `aux_weight` is set by training to
`router_aux_loss_coef / (MoE layers · sequences in the global batch)` (times FSDP's scale);
alone it is that with this microbatch's sequences. Each forward records (aux sum, tokens per
expert) in `stats` for the metrics; the trainer empties it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.models.kernels import grouped_gemm_ok
from mesh3d.models.llama import MLP
from mesh3d.torch_private import grouped_mm, in_backward_recompute
from mesh3d.tp_local import local_of


class _AttachAux(torch.autograd.Function):
    """Identity on `x`; in backward, `weight` is the gradient of `aux` (as if `weight · aux`
    had been added to the loss)."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.weight, dtype=torch.float32, device=grad.device)
        return grad, aux_grad, None


def attach_aux(x: Tensor, aux: Tensor, weight: float) -> Tensor:
    """`x`, with `weight · aux` contributing to the gradient in backward."""
    return _AttachAux.apply(x, aux, weight)


class Experts(nn.Module):
    """E SwiGLU experts as two stacked parameters (Nanotron's `GroupedMLP` layout)."""

    def __init__(self, num_experts: int, h: int, ffn: int, act):
        super().__init__()
        self.merged_gate_up_proj = nn.Parameter(torch.empty(num_experts, h, 2 * ffn))
        self.merged_down_proj = nn.Parameter(torch.empty(num_experts, ffn, h))
        self.act = act

    def unbound(self, weights=lambda p: p) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Every expert's (gate_up, down) weights as views, split once per forward: indexing the
        stacks per expert would make each expert's backward write a zero gradient the size of
        the whole stack; one unbind gathers them in one."""
        return weights(self.merged_gate_up_proj).unbind(0), weights(self.merged_down_proj).unbind(0)

    def run(self, x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
        """One expert (its weights) on tokens x [n, h]."""
        gate, up = (x @ gate_up).chunk(2, dim=-1)
        return (self.act(gate) * up) @ down

    grouped_mm = True  # False: always the loop over experts (benchmarks/moe.py compares)

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether `run_sorted` takes the grouped GEMM for inputs like `x` (`grouped_gemm_ok`)."""
        h, f2 = self.merged_gate_up_proj.shape[-2:]
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # the GEMMs run in autocast's dtype
            dtype = torch.get_autocast_dtype(x.device.type)
        return self.grouped_mm and grouped_gemm_ok(h, f2 // 2, dtype.itemsize, x.device, dtype)

    def run_sorted(self, rows: Tensor, counts: Tensor, weights=lambda p: p) -> Tensor:
        """Every expert on its rows: `rows` [n, h] grouped by expert (the first counts[0] rows
        are expert 0's, then expert 1's, ...); returns [n, h] in the same order. Two grouped
        GEMMs (`torch._grouped_mm`, offsets = the running sum of `counts`) where
        `uses_grouped_mm`, else a loop over the experts that have rows; equal results (under
        autocast in its dtype: the GEMMs run in it, as autocast runs mm)."""
        gate_up, down = weights(self.merged_gate_up_proj), weights(self.merged_down_proj)
        if self.uses_grouped_mm(rows):
            kind = rows.device.type
            if torch.is_autocast_enabled(kind):  # autocast does not cover _grouped_mm: as for mm
                low = torch.get_autocast_dtype(kind)
                rows, gate_up, down = rows.to(low), gate_up.to(low), down.to(low)
            ends = counts.cumsum(0).to(torch.int32)
            gate, up = grouped_mm(rows, gate_up, offs=ends).chunk(2, dim=-1)
            return grouped_mm(self.act(gate) * up, down, offs=ends)
        gate_ups, downs = gate_up.unbind(0), down.unbind(0)
        parts = rows.split(counts.tolist())
        ran = [self.run(x, gate_ups[e], downs[e]) for e, x in enumerate(parts) if len(x)]
        return torch.cat(ran) if ran else rows


class SharedExpertMLP(MLP):
    """The shared expert: Llama's MLP (HF's and Nanotron's names), run with the weights the
    block hands it (local tensors under tensor parallelism)."""

    def forward(self, x: Tensor, weights=lambda p: p) -> Tensor:
        gate, up = (
            F.linear(x, weights(self.gate_proj.weight)),
            F.linear(x, weights(self.up_proj.weight)),
        )
        return F.linear(self.act(gate) * up, weights(self.down_proj.weight))


def moe_layers(cfg) -> list[int]:
    """The 0-based layers whose MLP is an MoE block: `moe_config.layers` ([-1]: every layer)."""
    moe = getattr(cfg, "moe_config", None)
    if moe is None:
        return []
    if list(moe.layers) == [-1]:
        return list(range(cfg.num_hidden_layers))
    return sorted(set(moe.layers))


class MoE(nn.Module):
    """x [B, S, h] -> [B, S, h]: routed experts (+ the gated shared expert). See the module doc."""

    def __init__(self, h: int, moe, act, num_moe_layers: int = 1, norm_topk_prob: bool = False):
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(h, moe.num_experts, bias=False)  # the router (HF's name)
        self.experts = Experts(moe.num_experts, h, moe.moe_intermediate_size, act)
        self.shared = bool(moe.enable_shared_expert)
        if self.shared:
            self.shared_expert = SharedExpertMLP(h, moe.shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.aux_coef = moe.router_aux_loss_coef
        self.num_moe_layers = num_moe_layers
        self.aux_weight: float | None = None  # set by training (module doc)
        self.stats: list[tuple[Tensor, Tensor]] = []
        # set by the parallel code, which this file does not import:
        # - under tensor parallelism (`tp_family_styles.py::ExpertsReplicated`) the weights are
        #   replicated DTensors, used locally with gradients of this placement;
        # - when a sequence's tokens are split over ranks (tp under sequence parallelism, cp),
        #   one `f(t) -> group size` per split sums the load statistics over it in place
        #   (`tp_styles.py::summed_over`);
        # - expert parallelism: a `parallel.experts.ExpertParallel`; this rank holds E/ep experts
        self.grad_placement = None
        self.sequence_sums: list = []
        self.ep = None

    def _w(self, p: Tensor) -> Tensor:
        """A weight as the local tensor the block computes with."""
        if self.grad_placement is None:
            return p
        return local_of(p, self.grad_placement)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probabilities [B, S, E] fp32, top-k weights [B, S, k] fp32, top-k experts [B, S, k])."""
        with torch.autocast(x.device.type, enabled=False):  # fp32 even under autocast
            logits = F.linear(x.float(), self._w(self.gate.weight).float())
            probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:  # in fp32, before the weights meet the activations' dtype
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def aux_per_sequence(self, probs: Tensor, experts: Tensor) -> Tensor:
        """E · Σₑ fₑ · Pₑ for each sequence [B] (module doc).

        When a sequence's tokens are split over ranks (`sequence_sums`: sequence parallelism,
        context parallelism), the counts behind f are summed over them and each rank returns its
        tokens' share of the sum over P: the ranks' values add up to the sequence's, and so do
        their gradients (no differentiable collective needed).
        """
        b, s, e = probs.shape
        chosen = torch.zeros(b, e, device=probs.device, dtype=probs.dtype)
        picks = experts.reshape(b, -1)
        chosen.scatter_add_(1, picks, torch.ones_like(picks, dtype=probs.dtype))
        for sum_over in self.sequence_sums:
            s = s * sum_over(chosen)
        share = chosen / (s * self.top_k)  # f: fraction of the sequence's routed slots
        return e * (share * probs.sum(dim=1) / s).sum(dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        probs, weights, experts = self.route(x)
        flat, out = x.reshape(-1, h), torch.zeros(b * s, h, dtype=x.dtype, device=x.device)
        flat_experts, flat_weights = (
            experts.reshape(-1, self.top_k),
            weights.reshape(-1, self.top_k),
        )
        counts = torch.bincount(flat_experts.reshape(-1), minlength=self.num_experts)
        if self.ep is not None:  # the experts live on the ep ranks: all-to-all there and back

            def run(rows: Tensor, local_counts: Tensor) -> Tensor:
                return self.experts.run_sorted(rows, local_counts, self._w)

            out = self.ep.dispatch(run, flat, flat_experts, flat_weights, self.num_experts)
        else:  # dropless: every routed (token, slot), grouped by expert
            order = torch.argsort(flat_experts.reshape(-1), stable=True)
            token = order // self.top_k
            rows = self.experts.run_sorted(flat[token], counts, self._w)
            w = flat_weights.reshape(-1)[order, None].to(x.dtype)
            out = out.index_add(0, token, rows * w)
        out = out.view(b, s, h)
        if self.shared:
            gate = torch.sigmoid(F.linear(x, self._w(self.shared_expert_gate.weight)))
            out = out + gate * self.shared_expert(x, self._w)
        aux = self.aux_per_sequence(probs, experts).sum()
        if not in_backward_recompute():  # not a recompute inside backward
            self.stats.append((aux.detach(), counts.detach()))
        if self.training and self.aux_coef and torch.is_grad_enabled():
            weight = self.aux_weight
            if weight is None:  # outside training: this microbatch's mean over sequences
                weight = self.aux_coef / (self.num_moe_layers * b)
            out = attach_aux(out, aux, weight)
        return out
