"""Mixture of experts (Nanotron's Qwen2 `moe_config`).

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_moe.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs
from test_moe import MOE, _block

TOL = 1e-5


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
