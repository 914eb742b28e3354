"""`name: muon` at every layout: dp2 x tp2 x pp2 with ZeRO-1 and dp4 x tp2 with full shard
train like one process within 1e-5 (Newton-Schulz in float32: `ns_dtype`), and a resume from
a mid-run checkpoint continues bitwise at the same layout and within 1e-5 at another.

Newton-Schulz's quintic step has slope 3.4 at zero, so over 5 steps it multiplies the ~1e-7
layout differences of a gradient along its small singular directions by up to ~450; the update
then moves the weights by lr x that. At lr 0.005 (here) the largest difference is 3.8e-6; at
lr 0.02 it was 1.3e-5 (measured 2026-12-05), the same amplification, not a layout error.

One 1-rank launch (the reference, 4 steps, and a run that saves at step 2) and one 8-rank
launch (both layouts; a resume of the 1-rank step-2 checkpoint at 2 x 2 x 2, and of a 2 x 2 x 2
step-2 checkpoint at the same layout).
"""

from __future__ import annotations

from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs

MUON = ["optimizer.optimizer_factory={name: muon, ns_dtype: float32}", "tokens.train_steps=4",
        "optimizer.learning_rate_scheduler.learning_rate=0.005", "model.model_config.num_hidden_layers=4"]  # fmt: skip


def _ck(root, name: str, resume: str | None = None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={root / name}", "checkpoints.checkpoint_interval=2"]
    return out + ([f"checkpoints.resume_checkpoint_path={root / resume}"] if resume else [])


def test_muon_at_every_layout_equals_one_process_and_resumes(tmp_path):
    one = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    ref, _ = run_ranks(1, train_runs, [MUON + one + _ck(tmp_path, "ref"),
                                        MUON + one + _ck(tmp_path, "one")], timeout=300)[0]  # fmt: skip
    three_d = layout_overrides(2, 2, "REDUCE_SCATTER", 1, False) + ["parallelism.pp=2"]
    fsdp = layout_overrides(4, 2, "ALL_REDUCE", 0, False) + ["mesh3d.full_shard=true"]
    runs = [
        MUON + three_d + _ck(tmp_path, "3d"),
        MUON + fsdp + _ck(tmp_path, "fsdp"),
        MUON + three_d + _ck(tmp_path, "3d_from_one", "one/2"),
        MUON + three_d + _ck(tmp_path, "3d_again", "3d/2"),
    ]
    results = run_ranks(8, train_runs, runs, timeout=600)
    three, full, from_one, again = results[0]
    diffs = {"dp2 x tp2 x pp2, zero 1": max_rel_diff(three, ref),
             "dp4 x tp2, full shard": max_rel_diff(full, ref),
             "2x2x2 resumed from one process's step 2": max_rel_diff(from_one, _tail(ref))}  # fmt: skip
    print("\nMuon + AdamW vs one process, max relative difference:",
          {k: f"{v:.1e}" for k, v in diffs.items()})  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    assert ref["loss"][-1] < ref["loss"][0]
    assert again["loss"] == three["loss"][2:]  # a resume at the same layout: bitwise
    assert again["grad_norm"] == three["grad_norm"][2:]
    assert all(torch_equal(again["weights"][k], three["weights"][k]) for k in three["weights"])
    for r in results[1:]:
        assert r[0]["loss"] == three["loss"]


def _tail(run: dict) -> dict:
    """`run` from step 3 on: what a run resumed from its step-2 checkpoint trains."""
    return {**run, "loss": run["loss"][2:], "grad_norm": run["grad_norm"][2:]}


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
