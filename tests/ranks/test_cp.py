"""Context parallelism (the sequence split over the "cp" axis) equals one process.

- the rank order and the token split, computed arithmetically;
- attention across shards (causal, sliding window, documents) against one-process SDPA,
  forward and gradients;
- training parity (fp32, loss, grad norm and weights <= 1e-5 relative) at cp 2 (with zero 1 and
  activation recompute) and 4, cp2 x tp2, cp2 x pp2, cp2 x dp2 with zero 1, dp1 x cp2 x tp2 x
  pp2, and Qwen2 with document masking, sliding windows and NoPE layers;
- a cp2 checkpoint resumes at cp1 and a cp1 one at cp2, continuing the uninterrupted run.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_cp_unit.py`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs

from mesh3d.mesh import ParallelDims
from mesh3d.models.llama import attention_mask
from mesh3d.parallel.context import shard_sequence

TOL = 1e-5
CP = "parallelism.context_parallel_size"


# ---------------------------------------------------------------- attention across shards


def _attention_cases(rank: int, world: int) -> list[dict]:
    """Inside a rank: cp attention on the cp=world mesh and on a dp2 x cp(world/2) mesh, against
    one-process SDPA with the same mask; forward outputs and q/k/v gradients."""
    from mesh3d.mesh import build_mesh
    from mesh3d.parallel.context import ContextParallel, cp_attention

    torch.manual_seed(0)
    b, s, nq, nkv, dh = 2, 16, 4, 2, 8
    q, k, v = (torch.randn(b, s, n, dh) for n in (nq, nkv, nkv))
    grad_out = torch.randn(b, s, nq, dh)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                              [3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6]])  # fmt: skip
    out = []
    for dims in (ParallelDims(1, 1, 1, cp=world), ParallelDims(2, 1, 1, cp=world // 2)):
        mesh = build_mesh(dims, "cpu")
        cp_mesh = mesh["cp"]
        n, r = cp_mesh.size(), cp_mesh.get_local_rank()
        for window, docs in ((None, False), (5, False), (None, True), (6, True)):
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            mask = attention_mask(positions if docs else None, s, window, "cpu")
            qt, kt, vt = (t.transpose(1, 2) for t in ref)
            if mask is None:
                full = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            else:
                full = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
            full = full.transpose(1, 2)
            full.backward(grad_out)
            cp = ContextParallel(cp_mesh.get_group(), n, r, documents=docs)
            mine = [shard_sequence(t, n, r).requires_grad_() for t in (q, k, v)]
            pos = shard_sequence(positions if docs else torch.arange(s).expand(b, s), n, r)
            got = cp_attention(*mine, pos, window, cp)
            got.backward(shard_sequence(grad_out, n, r))
            diffs = [float((got - shard_sequence(full, n, r)).abs().max())]
            diffs += [float((m.grad - shard_sequence(t.grad, n, r)).abs().max())
                      for m, t in zip(mine, ref)]  # fmt: skip
            out.append(dict(cp=n, window=window, docs=docs, diff=max(diffs)))
    return out


def test_cp_attention_equals_one_process_forward_and_backward():
    results = run_ranks(4, _attention_cases, timeout=120)
    for rank, cases in enumerate(results):
        assert {c["cp"] for c in cases} == {4, 2}
        for c in cases:
            assert c["diff"] <= 1e-5, (rank, c)


# ---------------------------------------------------------------- training parity


def _llama(dp: int, tp: int, cp: int, mode: str = "ALL_REDUCE", zero: int = 0) -> list[str]:
    return layout_overrides(dp, tp, mode, zero, False) + [f"{CP}={cp}"]


def _pp2(schedule: str = "1f1b") -> list[str]:
    return ["parallelism.pp=2", f"mesh3d.pp_schedule={schedule}"]


LAYOUTS = {
    2: [
        ("cp2", _llama(1, 1, 2)),
        (
            "cp2 zero1 recompute_layer",
            _llama(1, 1, 2, zero=1) + ["parallelism.recompute_layer=true"],
        ),
    ],
    4: [
        ("cp4", _llama(1, 1, 4)),
        ("cp2 tp2 ALL_REDUCE", _llama(1, 2, 2)),
        ("cp2 tp2 REDUCE_SCATTER zero1", _llama(1, 2, 2, "REDUCE_SCATTER", 1)),
        ("cp2 pp2 1f1b", _llama(1, 1, 2) + _pp2()),
        ("cp2 dp2 zero1", _llama(2, 1, 2, zero=1)),
    ],
    8: [
        (
            "dp1 cp2 tp2 pp2 REDUCE_SCATTER zero1 1f1b",
            _llama(1, 2, 2, "REDUCE_SCATTER", 1) + _pp2(),
        ),
        ("dp2 cp2 tp2 ALL_REDUCE zero0", _llama(2, 2, 2)),
    ],
}


@pytest.fixture(scope="module")
def reference() -> dict:
    (ref,) = run_ranks(1, train_runs, [layout_overrides(1, 1, "ALL_REDUCE", 0, False)],
                       timeout=120)[0]  # fmt: skip
    assert ref["loss"][-1] < ref["loss"][0] and min(ref["grad_norm"]) > 0.05
    return ref


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_cp_layouts_match_one_process(world, reference):
    names = [name for name, _ in LAYOUTS[world]]
    results = run_ranks(world, train_runs, [o for _, o in LAYOUTS[world]], timeout=500)
    table = {n: max_rel_diff(run, reference) for n, run in zip(names, results[0])}
    print(f"\ncp parity, world {world}:", {k: f"{v:.1e}" for k, v in table.items()})
    for runs_of_rank in results:
        for name, run, first in zip(names, runs_of_rank, results[0]):
            assert run["loss"] == first["loss"], name  # every rank reports the global loss
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table


def test_qwen2_documents_windows_nope_at_cp():
    """Qwen2 with document masking, a sliding window, NoPE layers and z-loss."""
    from test_qwen2 import QWEN, STEPS, _diff

    runs = [("cp2", _llama(1, 1, 2)), ("cp2 pp2", _llama(1, 1, 2) + _pp2()),
            ("cp2 tp2 REDUCE_SCATTER zero1", _llama(1, 2, 2, "REDUCE_SCATTER", 1))]  # fmt: skip
    tied = "model.model_config.tie_word_embeddings=true"
    (ref,) = run_ranks(1, train_runs, [_llama(1, 1, 1) + [STEPS, tied]], QWEN, timeout=120)[0]
    two = run_ranks(2, train_runs, [o + [STEPS, tied] for _, o in runs[:1]], QWEN, timeout=300)
    four = run_ranks(4, train_runs, [o + [STEPS, tied] for _, o in runs[1:]], QWEN, timeout=400)
    got = two[0] + four[0]
    table = {name: _diff(run, ref) for (name, _), run in zip(runs, got)}
    print("\nqwen2 cp parity:", table)
    assert all(v <= TOL for v in table.values()), table


# ---------------------------------------------------------------- resume at another cp


def test_checkpoints_resume_at_another_cp(tmp_path):
    """cp2 saves at step 2, cp1 resumes; cp1 saves at step 2, cp2 resumes: both continue the
    uninterrupted cp2 run. The cp2 checkpoint holds the same files as the cp1 one."""
    steps = lambda n: f"tokens.train_steps={n}"  # noqa: E731

    def save(name):
        return [
            f"checkpoints.checkpoints_path={tmp_path / name}",
            "checkpoints.checkpoint_interval=2",
        ]

    def resume(name):
        return [f"checkpoints.resume_checkpoint_path={tmp_path / name}",
                f"checkpoints.checkpoints_path={tmp_path / (name + '-more')}",
                "checkpoints.checkpoint_interval=100"]  # fmt: skip

    (from_cp1,) = run_ranks(1, train_runs, [_llama(1, 1, 1) + [steps(2)] + save("cp1")],
                            timeout=120)[0]  # fmt: skip
    straight, _, resumed_cp2 = run_ranks(2, train_runs, [
        _llama(1, 1, 2) + [steps(4)],
        _llama(1, 1, 2) + [steps(2)] + save("cp2"),
        _llama(1, 1, 2) + [steps(4)] + resume("cp1"),
    ], timeout=300)[0]  # fmt: skip
    (resumed_cp1,) = run_ranks(1, train_runs, [_llama(1, 1, 1) + [steps(4)] + resume("cp2")],
                               timeout=120)[0]  # fmt: skip
    want = torch.tensor(straight["loss"][2:])
    for got in (resumed_cp1["loss"], resumed_cp2["loss"]):
        assert float((torch.tensor(got) - want).abs().max() / want.abs().max()) <= TOL, (got, want)
    files = {
        name: sorted(str(p.relative_to(tmp_path / name / "2"))
                     for p in (tmp_path / name / "2").rglob("*") if p.is_file())
        for name in ("cp1", "cp2")
    }  # fmt: skip
    assert files["cp1"] == files["cp2"]
    meta = json.loads((tmp_path / "cp2" / "2" / "checkpoint_metadata.json").read_text())
    assert meta["cp"] == 2
    assert from_cp1["loss"] == pytest.approx(straight["loss"][:2], rel=TOL)
