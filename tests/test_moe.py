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
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from parity import TINY, layout_overrides, max_rel_diff, train_runs

from mesh3d.config.schema import MoEConfig, Qwen2Config, Qwen3Config
from mesh3d.models.moe import MoE, attach_aux, moe_layers
from mesh3d.models.qwen2 import Qwen2
from mesh3d.models.qwen3 import Qwen3

TOL = 1e-5
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
            out,
            x.grad,
            experts.merged_gate_up_proj.grad,
            experts.merged_down_proj.grad,
        )
    experts.grouped_mm = True
    gu, down = experts.unbound()
    first = torch.cat([experts.run(rows[i : i + 1], gu[e], down[e]) for i, e in
                       enumerate(torch.repeat_interleave(torch.arange(5), counts).tolist())])  # fmt: skip
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


# ---------------------------------------------------------------- expert-parallel dispatch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).abs().max() / b.abs().max())


def _dispatchers(rank: int, world: int) -> dict:
    """On each rank: the block (4 experts, top 2) with its experts split over the ranks,
    dispatching by all-to-all and by all-gather, against the whole block in one process on each
    rank's tokens: the output, the input's and the router's gradients (this rank's tokens), the
    expert gradients (every rank's tokens, this rank's experts). Twice: random routing, and
    every token routed to rank 0's experts (rank 1 runs none). Then unequal token counts."""
    import torch.distributed as dist

    from mesh3d.parallel.experts import ExpertParallel

    got = {}
    for case in ("random", "all to rank 0"):
        whole = _block(shared=False, experts=4)
        whole.aux_coef = 0.0  # the dispatch alone: no aux gradient into the router
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(2, 6, 16, generator=g) for _ in range(world)]
        grads = [torch.randn(2, 6, 16, generator=g) for _ in range(world)]
        if case != "random":  # a large first feature that only experts 0 and 1 weigh
            with torch.no_grad():
                whole.gate.weight[:2, 0] = 10.0
            for x in xs:
                x[..., 0] = 3.0
            assert set(whole.route(xs[rank])[2].unique().tolist()) == {0, 1}
        want = []  # per rank: output, input grad, router grad, expert grads
        for x, gr in zip(xs, grads):
            whole.zero_grad()
            x = x.clone().requires_grad_()
            out = whole(x)
            out.backward(gr)
            want.append((out.detach(), x.grad, whole.gate.weight.grad.clone(),
                         [p.grad.clone() for p in whole.experts.parameters()]))  # fmt: skip
        lo, hi = rank * 4 // world, (rank + 1) * 4 // world
        mine = [sum(w[3][i] for w in want)[lo:hi] for i in range(2)]
        for kind in ("alltoall", "allgather"):
            block = copy.deepcopy(whole)
            block.zero_grad()
            for name, p in list(block.experts.named_parameters()):
                block.experts.register_parameter(name, torch.nn.Parameter(p.detach()[lo:hi]))
            block.ep = ExpertParallel(dist.group.WORLD, world, rank, kind)
            x = xs[rank].clone().requires_grad_()
            out = block(x)
            out.backward(grads[rank])
            o, xg, rg, _ = want[rank]
            got[case, kind] = {
                "out": _rel(out, o), "x grad": _rel(x.grad, xg), "router grad": _rel(block.gate.weight.grad, rg),
                **{f"expert grad {i}": _rel(p.grad, m) if p.grad is not None and m.abs().max() > 0
                   else float(p.grad is not None and p.grad.abs().max() > 0)
                   for i, (p, m) in enumerate(zip(block.experts.parameters(), mine))},
            }  # fmt: skip
    block.ep = ExpertParallel(dist.group.WORLD, world, rank, "allgather")
    with pytest.raises(ValueError, match=r"the same number of tokens .* got \[12, 10\]"):
        block(torch.randn(2, 6 - rank, 16))
    return got


def test_allgather_dispatch_equals_all_to_all_and_one_process():
    """2 forked gloo ranks (`_dispatchers`): both dispatchers give the one-process output and
    gradients (fp32, <= 1e-5 relative), the router's included: under all-gather a weight's
    gradient is made on the rank that ran its expert and the gather's backward (a
    reduce-scatter) brings it home. A rank whose experts get no token is fine. Unequal token
    counts raise a ValueError on every rank (no hang)."""
    for got in run_ranks(2, _dispatchers, timeout=60):
        for key, diffs in got.items():
            assert all(v <= TOL for v in diffs.values()), (key, diffs)


# ---------------------------------------------------------------- training parity


CP2 = "parallelism.context_parallel_size=2"


def EP(n: int) -> str:  # noqa: N802
    return f"parallelism.expert_parallel_size={n}"


EP2 = EP(2)
ALLGATHER = "model.model_config.moe_config.token_dispatcher_type=allgather"


def _pp2(schedule: str = "1f1b") -> list[str]:
    return ["parallelism.pp=2", f"mesh3d.pp_schedule={schedule}"]


LAYOUTS = {
    2: [("dp2 zero0", layout_overrides(2, 1, "ALL_REDUCE", 0, False)),
        ("dp2 zero1", layout_overrides(2, 1, "ALL_REDUCE", 1, False)),
        ("pp2 1f1b", layout_overrides(1, 1, "ALL_REDUCE", 0, False) + _pp2()),
        ("tp2 ALL_REDUCE", layout_overrides(1, 2, "ALL_REDUCE", 0, False)),
        ("tp2 REDUCE_SCATTER zero1", layout_overrides(1, 2, "REDUCE_SCATTER", 1, False)),
        ("cp2", layout_overrides(1, 1, "ALL_REDUCE", 0, False) + [CP2]),
        ("dp2 ep2", layout_overrides(2, 1, "ALL_REDUCE", 0, False) + [EP2]),
        ("dp2 ep2 zero1", layout_overrides(2, 1, "ALL_REDUCE", 1, False) + [EP2]),
        ("dp2 ep2 allgather", layout_overrides(2, 1, "ALL_REDUCE", 0, False) + [EP2, ALLGATHER])],
    4: [("dp2 pp2 zero1 1f1b", layout_overrides(2, 1, "ALL_REDUCE", 1, False) + _pp2()),
        ("cp2 tp2 ALL_REDUCE", layout_overrides(1, 2, "ALL_REDUCE", 0, False) + [CP2]),
        ("dp4 ep4", layout_overrides(4, 1, "ALL_REDUCE", 0, False) + [EP(4)]),
        ("dp4 ep2 zero1", layout_overrides(4, 1, "ALL_REDUCE", 1, False) + [EP2]),
        ("dp2 ep2 tp2 ALL_REDUCE", layout_overrides(2, 2, "ALL_REDUCE", 0, False) + [EP2]),
        ("dp2 ep2 pp2 1f1b", layout_overrides(2, 1, "ALL_REDUCE", 0, False) + _pp2() + [EP2]),
        ("dp2 ep2 cp2", layout_overrides(2, 1, "ALL_REDUCE", 0, False) + [EP2, CP2]),
        ("dp2 ep2 tp2 REDUCE_SCATTER allgather",
         layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + [EP2, ALLGATHER]),
        ("dp2 ep2 pp2 1f1b allgather zero1",
         layout_overrides(2, 1, "ALL_REDUCE", 1, False) + _pp2() + [EP2, ALLGATHER]),
        ("dp4 zero0", layout_overrides(4, 1, "ALL_REDUCE", 0, False))],
    8: [("dp2 ep2 tp2 pp2 REDUCE_SCATTER zero1 1f1b",
         layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + _pp2() + [EP2]),
        ("dp2 tp2 pp2 REDUCE_SCATTER zero1 1f1b",
         layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + _pp2()),
        ("cp2 tp2 pp2 REDUCE_SCATTER zero1 1f1b",
         layout_overrides(1, 2, "REDUCE_SCATTER", 1, False) + _pp2() + [CP2])],
}  # fmt: skip


@pytest.fixture(scope="module")
def reference() -> dict:
    base = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    ref, no_aux = run_ranks(
        1, train_runs, [base, base + ["model.model_config.moe_config.router_aux_loss_coef=0"]],
        MOE, timeout=120,
    )[0]  # fmt: skip
    assert ref["loss"][-1] < ref["loss"][0] and min(ref["grad_norm"]) > 0.05
    assert len(ref["moe"]) == 5 and all(aux > 0 and load >= 1 for aux, load in ref["moe"])
    # the aux loss changes training (its gradient is applied), not the first step's loss
    assert no_aux["loss"][0] == ref["loss"][0] and no_aux["grad_norm"][0] != ref["grad_norm"][0]
    assert no_aux["moe"][0][0] == 0.0
    return ref


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_moe_layouts_match_one_process(world, reference):
    names = [name for name, _ in LAYOUTS[world]]
    results = run_ranks(world, train_runs, [o for _, o in LAYOUTS[world]], MOE, timeout=400)
    table = {n: max_rel_diff(run, reference) for n, run in zip(names, results[0])}
    print(f"\nmoe parity, world {world}:", {k: f"{v:.1e}" for k, v in table.items()})
    for name, run in zip(names, results[0]):  # the same routing: the same aux loss and load
        got, want = torch.tensor(run["moe"]), torch.tensor(reference["moe"])
        assert float((got - want).abs().max() / want.abs().max()) <= TOL, (name, got, want)
    for runs_of_rank in results:
        for name, run, first in zip(names, runs_of_rank, results[0]):
            assert run["loss"] == first["loss"] and run["moe"] == first["moe"], name
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table


def test_moe_checkpoint_is_nanotrons_layout_and_resumes_at_another_layout(tmp_path):
    ck = [f"checkpoints.checkpoints_path={tmp_path / 'ck'}", "checkpoints.checkpoint_interval=2"]
    dp2 = layout_overrides(2, 1, "ALL_REDUCE", 1, False)
    straight, _ = run_ranks(2, train_runs, [dp2 + ["tokens.train_steps=4"],
                                            dp2 + ["tokens.train_steps=2", *ck]],
                            MOE, timeout=300)[0]  # fmt: skip
    mlp = tmp_path / "ck" / "2" / "model" / "model" / "decoder" / "0" / "pp_block" / "mlp"
    files = sorted(str(p.relative_to(mlp)) for p in mlp.rglob("*.safetensors"))
    assert files == [
        "experts/model_merged_down_proj.safetensors",
        "experts/model_merged_gate_up_proj.safetensors",
        "router/model_weight.safetensors",
        "shared_expert/down_proj/model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors",
        "shared_expert/gate_up_proj/model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors",
        "shared_expert_gate/model_weight.safetensors",
    ], files
    dense = mlp.parent.parent.parent / "1" / "pp_block" / "mlp"  # layer 1 is dense
    assert sorted(p.name for p in dense.iterdir()) == ["down_proj", "gate_up_proj"]
    resume = [f"checkpoints.resume_checkpoint_path={tmp_path / 'ck'}", "tokens.train_steps=4",
              f"checkpoints.checkpoints_path={tmp_path / 'ck2'}", "checkpoints.checkpoint_interval=100"]  # fmt: skip
    (resumed,) = run_ranks(2, train_runs, [layout_overrides(1, 1, "ALL_REDUCE", 0, False)
                                           + _pp2() + resume], MOE, timeout=300)[0]  # fmt: skip
    got, want = torch.tensor(resumed["loss"]), torch.tensor(straight["loss"][2:])
    assert float((got - want).abs().max() / want.abs().max()) <= TOL, (got, want)


def test_expert_parallel_checkpoint_has_exp_rank_files_and_resumes_at_another_ep(tmp_path):
    """ep2 (of dp2) saves each ep rank's experts in its own file (Nanotron's `_exp-rank-E-of-EP`
    names); one process resumes it, and an ep1 checkpoint resumes at ep2: both continue the
    uninterrupted ep2 run."""

    def save(name):
        return [
            f"checkpoints.checkpoints_path={tmp_path / name}",
            "checkpoints.checkpoint_interval=2",
        ]

    def resume(name):
        return [f"checkpoints.resume_checkpoint_path={tmp_path / name}", "tokens.train_steps=4",
                f"checkpoints.checkpoints_path={tmp_path / (name + '-more')}",
                "checkpoints.checkpoint_interval=100"]  # fmt: skip

    dp2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)
    straight, _, _, from_ep1 = run_ranks(2, train_runs, [
        dp2 + [EP2, "tokens.train_steps=4"],
        dp2 + [EP2, "tokens.train_steps=2", *save("ep2")],
        dp2 + ["tokens.train_steps=2", *save("ep1")],
        dp2 + [EP2, *resume("ep1")],
    ], MOE, timeout=300)[0]  # fmt: skip
    experts = tmp_path / "ep2" / "2" / "model" / "model" / "decoder" / "0" / "pp_block" / "mlp"
    assert sorted(p.name for p in (experts / "experts").iterdir()) == [
        f"model_merged_{w}_pp-rank-0-of-1_tp-rank-0-of-1_exp-rank-{e}-of-2.safetensors"
        for w in ("down_proj", "gate_up_proj") for e in (0, 1)
    ]  # fmt: skip
    (from_ep2,) = run_ranks(1, train_runs, [layout_overrides(1, 1, "ALL_REDUCE", 0, False)
                                            + resume("ep2")], MOE, timeout=120)[0]  # fmt: skip
    want = torch.tensor(straight["loss"][2:])
    for got in (from_ep1["loss"], from_ep2["loss"]):
        assert float((torch.tensor(got) - want).abs().max() / want.abs().max()) <= TOL, (got, want)
