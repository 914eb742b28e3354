"""Mixture of experts (Nanotron's Qwen2 `moe_config`).

- the block against a token-by-token reference written from the definition (router softmax,
  top-k weights, each chosen expert's SwiGLU, the sigmoid-gated shared expert);
- `norm_topk_prob` (Qwen3-MoE): each token's top-k weights renormalized to sum 1; off, they
  are the router probabilities as they are (Nanotron's Qwen2);
- the load-balancing loss per sequence by hand, and its gradient, attached in backward, equal to
  adding it to the loss;
- training parity (fp32, <= 1e-5 relative in loss, grad norm and weights, against one process)
  at dp2 (zero 0 and 1), pp2, tp2 (both modes), cp2, dp2 x pp2, dp4, cp2 x tp2, dp2 x tp2 x pp2
  and cp2 x tp2 x pp2, and with the experts split over ep ranks (all-to-all dispatch): ep2,
  ep4, ep2 of dp4, ep2 x tp2, ep2 with pp2, ep2 with cp2 and dp2 x ep2 x tp2 x pp2; with
  `token_dispatcher_type: allgather`: ep2, ep2 x tp2 (sequence parallel), ep2 with pp2; with
  the shared expert and the aux loss on; the aux loss and the expert load are the same at every
  layout (the same routing);
- the two ep dispatchers (all-to-all, all-gather) on 2 ranks against the block in one process:
  output, input, router and expert gradients, also with a rank whose experts get no token;
  all-gather refuses unequal token counts;
- checkpoints in Nanotron's layout (router, stacked experts, shared expert files) resume at
  another layout.

The tests of this subject that need a process group are in `tests/ranks/test_moe_ranks.py`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from parity import TINY

from mesh3d.config.other_families import MoEConfig, Qwen2Config, Qwen3Config
from mesh3d.models.moe import MoE, attach_aux, moe_layers
from mesh3d.models.qwen2 import Qwen2
from mesh3d.models.qwen3 import Qwen3

MOE = copy.deepcopy(TINY)
_mc = MOE["model"]["model_config"]
_mc.pop("is_llama_config")
_mc.update(is_qwen2_config=True, num_hidden_layers=3,
           moe_config=dict(num_experts=4, top_k=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, enable_shared_expert=True,
                           router_aux_loss_coef=0.1, layers=[0, 2]))  # fmt: skip


def _block(shared: bool = True, seed: int = 0, experts: int = 5) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=experts, top_k=2, moe_intermediate_size=12,
                    shared_expert_intermediate_size=10, enable_shared_expert=shared,
                    router_aux_loss_coef=0.01)  # fmt: skip
    block = MoE(16, cfg, F.silu)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def test_block_equals_the_definition_token_by_token():
    block = _block()
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        out = block(x)
    want = torch.zeros_like(x)
    gu, down = block.experts.merged_gate_up_proj, block.experts.merged_down_proj
    for b in range(3):
        for s in range(7):
            t = x[b, s]
            probs = torch.softmax(block.gate.weight @ t, dim=-1)
            top = torch.argsort(probs, descending=True)[:2]
            for e in top.tolist():
                gate, up = (t @ gu[e]).chunk(2)
                want[b, s] += probs[e] * ((F.silu(gate) * up) @ down[e])
            sh = block.shared_expert
            mlp = sh.down_proj.weight @ (F.silu(sh.gate_proj.weight @ t) * (sh.up_proj.weight @ t))
            want[b, s] += torch.sigmoid(block.shared_expert_gate.weight @ t)[0] * mlp
    want = want.detach()
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_over_experts_forward_and_backward(dtype):
    """`torch._grouped_mm` (one GEMM per projection over every expert) against the loop over
    experts, on rows sorted by expert with one expert left empty: outputs and the gradients of
    the rows and both expert stacks agree (fp32 bitwise here; bf16 within its rounding)."""
    block = _block().to(dtype)
    experts = block.experts
    # F = 12: bf16 rows of 24 bytes are not 16-byte aligned, so bf16 needs F = 16
    assert experts.uses_grouped_mm(torch.empty(1, dtype=dtype)) == (dtype == torch.float32)
    if dtype == torch.bfloat16:
        experts.merged_gate_up_proj.data = torch.randn(5, 16, 32).to(dtype) * 0.3
        experts.merged_down_proj.data = torch.randn(5, 16, 16).to(dtype) * 0.3
        assert experts.uses_grouped_mm(torch.empty(1, dtype=dtype))
    counts = torch.tensor([3, 0, 5, 1, 4])
    rows = torch.randn(int(counts.sum()), 16, dtype=dtype)
    got = {}
    for grouped in (True, False):
        experts.grouped_mm = grouped
        experts.zero_grad()
        x = rows.clone().requires_grad_()
        out = experts.run_sorted(x, counts)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        got[grouped] = (
            out.detach(),
            x.grad,
            experts.merged_gate_up_proj.grad,
            experts.merged_down_proj.grad,
        )
    experts.grouped_mm = True
    gu, down = experts.unbound()
    first = torch.cat([experts.run(rows[i : i + 1], gu[e], down[e]) for i, e in
                       enumerate(torch.repeat_interleave(torch.arange(5), counts).tolist())]).detach()  # fmt: skip
    tol = 0 if dtype == torch.float32 else 2e-2
    for a, b in zip(got[True], got[False], strict=True):
        assert float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())
    assert float((got[True][0].float() - first.float()).abs().max()) <= max(tol, 1e-6) * float(
        first.float().abs().max()
    )
    assert got[True][2][1].abs().sum() == 0  # the empty expert gets no gradient


def test_aux_loss_per_sequence_by_hand():
    block = _block(shared=False)
    probs = torch.tensor([[[0.7, 0.1, 0.1, 0.05, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1]]])
    experts = torch.tensor([[[0, 1], [1, 2]]])  # slots: e0 once, e1 twice, e2 once (of 4)
    f = torch.tensor([1, 2, 1, 0, 0]) / 4
    p = probs[0].mean(0)
    assert torch.allclose(block.aux_per_sequence(probs, experts), (5 * (f * p).sum())[None])
    # per sequence: two sequences give two values, the same as each alone
    two = block.aux_per_sequence(torch.cat([probs, probs.flip(1)]), torch.cat([experts, experts]))
    assert torch.allclose(two, block.aux_per_sequence(probs, experts).expand(2))


def test_aux_gradient_attached_in_backward_equals_adding_it_to_the_loss():
    x = torch.randn(2, 6, 16)
    grad_out = torch.randn(2, 6, 16)
    attached, added = _block(seed=1), _block(seed=1)
    attached.aux_weight = added.aux_weight = 0.37
    attached(x).backward(grad_out)  # attach_aux inside
    added.aux_coef = 0.0  # nothing attached: the aux loss is added to the loss by hand
    probs, _, chosen = added.route(x)
    ((added(x) * grad_out).sum() + 0.37 * added.aux_per_sequence(probs, chosen).sum()).backward()
    for (name, a), b in zip(attached.named_parameters(), added.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    assert attached.gate.weight.grad.abs().sum() > 0
    # attach_aux is the identity forward
    y = torch.randn(3, requires_grad=True)
    assert torch.equal(attach_aux(y, y.sum(), 2.0), y)


def test_norm_topk_prob_renormalizes_the_top_k_weights_and_is_off_by_default():
    block = _block(shared=False)
    x = torch.randn(3, 7, 16)
    probs, plain, experts = block.route(x)
    assert not block.norm_topk_prob  # default: the top-k probabilities as they are
    assert torch.equal(plain, probs.gather(-1, experts)) and (plain.sum(-1) < 0.99).all()
    with torch.no_grad():
        out_plain = block(x)
    block.norm_topk_prob = True
    probs_n, normed, experts_n = block.route(x)
    assert torch.equal(probs_n, probs) and torch.equal(experts_n, experts)  # same routing
    assert torch.allclose(normed.sum(-1), torch.ones(3, 7), atol=1e-6)
    assert torch.allclose(normed, plain / plain.sum(-1, keepdim=True))
    with torch.no_grad():
        out_normed = block(x)
    # one expert per token (top_k 1): its weight becomes exactly 1, the output its expert's
    block.top_k = 1
    with torch.no_grad():
        only = block(x)
    _, w, e = block.route(x)
    assert torch.equal(w, torch.ones_like(w)) and not torch.allclose(out_normed, out_plain)
    gu, down = block.experts.unbound()
    want = torch.stack([block.experts.run(t[None], gu[i], down[i])[0]
                        for t, i in zip(x.reshape(-1, 16), e.flatten().tolist())])  # fmt: skip
    assert torch.allclose(only.reshape(-1, 16), want, atol=1e-6)


def test_moe_layers_and_model_parameters():
    moe = MoEConfig(num_experts=4, top_k=1, moe_intermediate_size=8, layers=[-1])
    cfg = Qwen2Config(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=3, vocab_size=40, moe_config=moe)  # fmt: skip
    assert moe_layers(cfg) == [0, 1, 2]
    moe.layers = [2, 0]
    assert moe_layers(cfg) == [0, 2]
    model = Qwen2(cfg)
    assert isinstance(model.layers["0"].mlp, MoE) and not isinstance(model.layers["1"].mlp, MoE)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.mlp.experts.merged_gate_up_proj" in names
    assert "layers.1.mlp.gate_proj.weight" in names and "layers.0.mlp.gate_proj.weight" not in names
    assert not model.layers["0"].mlp.norm_topk_prob  # Nanotron's Qwen2 MoE: not renormalized
    qwen3 = Qwen3Config(**{**dataclasses.asdict(cfg), "moe_config": moe}, norm_topk_prob=True)
    assert Qwen3(qwen3).layers["2"].mlp.norm_topk_prob
