"""Qwen2 (Nanotron's Qwen2Config): q/k/v bias, NoPE layers, sliding window, document masking
and z-loss, at every layout equal to one process; a packed sequence equal to its documents.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_qwen2.py`."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from parity import layout_overrides, train_runs
from test_qwen2 import QWEN, STEPS, _diff

TOL = 1e-5


def _pp(schedule: str, virtual: int) -> list[str]:
    return [
        "parallelism.pp=2",
        f"mesh3d.pp_schedule={schedule}",
        f"mesh3d.pp_virtual_stages={virtual}",
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    (ref,) = run_ranks(1, train_runs, [layout_overrides(1, 1, "ALL_REDUCE", 0, True) + [STEPS]],
                       QWEN, timeout=120)[0]  # fmt: skip
    assert ref["loss"][-1] < ref["loss"][0] and min(ref["grad_norm"]) > 0.05
    return ref


LAYOUTS = {
    2: [("pp2 1f1b", _pp("1f1b", 1)), ("pp2 interleaved_zero_bubble", _pp("interleaved_zero_bubble", 2))],
    4: [("dp2 tp2 REDUCE_SCATTER zero1", layout_overrides(2, 2, "REDUCE_SCATTER", 1, True)),
        ("dp2 tp2 ALL_REDUCE zero0", layout_overrides(2, 2, "ALL_REDUCE", 0, True))],
    8: [("dp2 tp2 pp2 1f1b REDUCE_SCATTER zero1", layout_overrides(2, 2, "REDUCE_SCATTER", 1, True)
         + _pp("1f1b", 1))],
}  # fmt: skip


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_qwen2_layouts_match_one_process(world, reference):
    names = [name for name, _ in LAYOUTS[world]]
    runs = [overrides + [STEPS] for _, overrides in LAYOUTS[world]]
    if world == 2:  # pp alone keeps the one-process batch layout
        runs = [layout_overrides(1, 1, "ALL_REDUCE", 0, True) + r for r in runs]
    results = run_ranks(world, train_runs, runs, QWEN, timeout=400)
    table = {n: _diff(run, reference) for n, run in zip(names, results[0])}
    print("\nqwen2 parity:", table)
    for runs_of_rank in results:
        for name, run in zip(names, runs_of_rank):
            assert not run["replica_mismatches"], (name, run["replica_mismatches"])
    assert all(v <= TOL for v in table.values()), table


def test_qwen2_checkpoint_has_nanotron_bias_files_and_resumes_at_another_layout(tmp_path):
    """Saved at dp2 x tp2, resumed at pp2: the same losses as the run that never stopped."""
    ck = [f"checkpoints.checkpoints_path={tmp_path / 'ck'}", "checkpoints.checkpoint_interval=2"]
    dp2tp2 = layout_overrides(2, 2, "REDUCE_SCATTER", 1, True)
    straight, _ = run_ranks(4, train_runs, [dp2tp2 + ["tokens.train_steps=4"],
                                            dp2tp2 + ["tokens.train_steps=2", *ck]],
                            QWEN, timeout=300)[0]  # fmt: skip
    qkv = (
        tmp_path
        / "ck"
        / "2"
        / "model"
        / "model"
        / "decoder"
        / "0"
        / "pp_block"
        / "attn"
        / "qkv_proj"
    )
    assert sorted(p.name for p in qkv.iterdir()) == [
        f"model_{leaf}_pp-rank-0-of-1_tp-rank-{t}-of-2.safetensors"
        for leaf in ("bias", "weight") for t in (0, 1)
    ]  # fmt: skip
    resume = [f"checkpoints.resume_checkpoint_path={tmp_path / 'ck'}", "tokens.train_steps=4",
              f"checkpoints.checkpoints_path={tmp_path / 'ck2'}", "checkpoints.checkpoint_interval=100"]  # fmt: skip
    (resumed,) = run_ranks(2, train_runs, [layout_overrides(1, 1, "ALL_REDUCE", 0, True)
                                           + _pp("1f1b", 1) + resume], QWEN, timeout=300)[0]  # fmt: skip
    got, want = torch.tensor(resumed["loss"]), torch.tensor(straight["loss"][2:])
    assert float((got - want).abs().max() / want.abs().max()) <= TOL, (got, want)
