"""`mesh3d.plan`: groups, stages and bubbles by hand; the CLI; memory numbers against real runs.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_plan.py`."""

from dist import run_ranks
from parity import layout_overrides
from plan_measure import (
    ONE_STEP,
    PP2,
    held_bytes,
    plan_cfg,
    pp_schedule,
    saved_peaks,
)

from mesh3d.plan import (
    make_plan,
)

RUNS_2X2X2 = {  # label -> overrides; TINY with 4 layers, 2 steps, global batch 8
    "zero0 untied RS 1f1b": layout_overrides(2, 2, "REDUCE_SCATTER", 0, False)
    + pp_schedule("1f1b"),
    "zero1 untied AR afab": layout_overrides(2, 2, "ALL_REDUCE", 1, False) + pp_schedule("afab"),
    "zero0 tied AR zbv": layout_overrides(2, 2, "ALL_REDUCE", 0, True, microbatches=4)
    + pp_schedule("zbv_zero_bubble", 2),
    "full_shard tied RS interleaved": layout_overrides(2, 2, "REDUCE_SCATTER", 1, True)
    + pp_schedule("interleaved_1f1b", 2)
    + ["mesh3d.full_shard=true"],
}


def test_plan_memory_equals_a_real_2x2x2_run():
    runs = [ov + PP2 for ov in RUNS_2X2X2.values()]
    measured = run_ranks(8, held_bytes, runs, timeout=240)
    for i, (label, overrides) in enumerate(RUNS_2X2X2.items()):
        plan = make_plan(plan_cfg(overrides + PP2), 8)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            want = dict(
                elements=rp.param_elements,
                params=rp.param_bytes,
                grads=rp.grad_bytes,
                optim=rp.optimizer_bytes,
            )
            assert got == want, f"{label}, rank {rank}: measured {got}, planned {want}"


PP2_M4 = PP2[:2] + ONE_STEP + ["tokens.batch_accumulation_per_replica=4"]


RUNS_ACTIVATIONS = {  # on 2 ranks
    "pp2 1f1b m4": PP2_M4 + pp_schedule("1f1b"),
    "pp2 afab m4": PP2_M4 + pp_schedule("afab"),
    "pp2 interleaved_1f1b m4": PP2_M4 + pp_schedule("interleaved_1f1b", 2),
    "pp2 zbv m4": PP2_M4 + pp_schedule("zbv_zero_bubble", 2),
    "pp2 1f1b m4 recompute": PP2_M4 + pp_schedule("1f1b") + ["parallelism.recompute_layer=true"],
    "tp2 sequence parallel": ONE_STEP
    + [
        "parallelism.tp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "tokens.batch_accumulation_per_replica=2",
    ],
}


def test_activation_estimate_matches_saved_tensors():
    measured = run_ranks(2, saved_peaks, list(RUNS_ACTIVATIONS.values()), timeout=120)
    report, bad = [], []
    for i, (label, overrides) in enumerate(RUNS_ACTIVATIONS.items()):
        plan = make_plan(plan_cfg(overrides), 2)
        for rank, rp in enumerate(plan.ranks):
            got, want = measured[rank][i], rp.saved_activation_bytes
            diff = got / want - 1
            report.append(f"{label} rank {rank}: measured {got}, planned {want} ({diff:+.2%})")
            if abs(diff) > 0.25:
                bad.append(report[-1])
    print("\n" + "\n".join(report))
    assert not bad, "\n".join(bad)
