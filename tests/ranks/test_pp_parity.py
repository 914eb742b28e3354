"""Pipeline parallelism parity: every schedule, alone and in full 3D, trains the one-process model.

3 steps with clipping active, fp32, against one process of the same config: the loss at every
step, the pre-clip grad norm and the final full weights (all stages merged; a tied head copy
must equal the embedding bitwise) within 1e-5 relative, replicated parameters bitwise equal.
- pp in {2, 4} alone: every schedule, microbatches in {pp, 2*pp} (V schedules need 2*pp);
- dp=2 x tp=2 x pp=2 (8 ranks), REDUCE_SCATTER: every schedule, once tied with zero_stage 1 and
  once untied with zero_stage 0;
- dp=2 x pp=2 with `mesh3d.compile`, recomputed layers and FSDP full sharding (ZeRO-1 for the
  zero-bubble schedules, which run each compiled backward in two passes): every schedule.
"""

import pytest
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs

TOL = 1e-5
STEPS = "tokens.train_steps=3"
SCHEDULES = {  # name -> stages per rank
    "afab": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
    "dualpipev": 2,
}
V_SHAPED = ("zbv_zero_bubble", "dualpipev")
ZERO_BUBBLE = ("interleaved_zero_bubble", *V_SHAPED)  # backward in two passes


def _layers(pp: int) -> str:
    return f"model.model_config.num_hidden_layers={4 if pp == 2 else 8}"


def _pp(pp: int, schedule: str) -> list[str]:
    v = SCHEDULES[schedule]
    return [
        f"parallelism.pp={pp}",
        f"mesh3d.pp_schedule={schedule}",
        f"mesh3d.pp_virtual_stages={v}",
    ]


def _pp_only_runs(pp: int) -> list[tuple]:
    return [
        (s, n)
        for s in SCHEDULES
        for n in (pp, 2 * pp)
        if not (s in V_SHAPED and n < 2 * pp)  # V schedules need microbatches >= stages
    ]


@pytest.fixture(scope="module")
def references() -> dict:
    runs = [
        layout_overrides(1, 1, "ALL_REDUCE", 0, tied) + [STEPS, _layers(pp)]
        for pp in (2, 4)
        for tied in (False, True)
    ]
    out = run_ranks(1, train_runs, runs, timeout=120)[0]
    return {(2, False): out[0], (2, True): out[1], (4, False): out[2], (4, True): out[3]}


def _check(results, labels, refs) -> None:
    table = {lab: max_rel_diff(run, ref) for lab, run, ref in zip(labels, results[0], refs)}
    report = "\n".join(f"{lab}: {v:.2e}" for lab, v in table.items())
    print(f"\npipeline parity (max relative difference):\n{report}")
    for r, runs in enumerate(results):
        for lab, run in zip(labels, runs):
            assert not run["replica_mismatches"], (r, lab, run["replica_mismatches"])
            assert run["loss"] == results[0][labels.index(lab)]["loss"], "all ranks log one loss"
    bad = {k: v for k, v in table.items() if not v <= TOL}
    assert not bad, f"off by more than {TOL}:\n{report}"


@pytest.mark.parametrize("pp", [2, 4])
def test_pp_schedules_match_one_process(pp, references):
    runs = _pp_only_runs(pp)
    overrides = [
        layout_overrides(1, 1, "ALL_REDUCE", 0, True, microbatches=n)
        + _pp(pp, s)
        + [STEPS, _layers(pp)]
        for s, n in runs
    ]
    results = run_ranks(pp, train_runs, overrides, timeout=400)
    labels = [f"pp={pp} {s} microbatches={n}" for s, n in runs]
    _check(results, labels, [references[(pp, True)]] * len(runs))


def test_3d_dp2_tp2_pp2_every_schedule(references):
    runs = [(s, tied, zero) for s in SCHEDULES for tied, zero in ((True, 1), (False, 0))]
    overrides = [
        layout_overrides(2, 2, "REDUCE_SCATTER", zero, tied, microbatches=4 if s in V_SHAPED else 2)
        + _pp(2, s)
        + [STEPS, _layers(2)]
        for s, tied, zero in runs
    ]
    results = run_ranks(8, train_runs, overrides, timeout=600)
    labels = [f"dp2 tp2 pp2 {s} tied={t} zero={z}" for s, t, z in runs]
    _check(results, labels, [references[(2, t)] for _, t, _ in runs])


def test_dp2_pp2_every_schedule_compiled(references):
    """Compiled blocks under every schedule at dp2 x pp2, with FSDP full sharding (ZeRO-1 for
    the zero-bubble schedules, which refuse full sharding); one launch (each rank compiles once,
    then reuses its graphs)."""
    overrides = [
        layout_overrides(2, 1, "ALL_REDUCE", 0 if s not in ZERO_BUBBLE else 1, True, microbatches=4)
        + _pp(2, s)
        + [STEPS, _layers(2), "mesh3d.compile=true", "parallelism.recompute_layer=true"]
        + ([] if s in ZERO_BUBBLE else ["mesh3d.full_shard=true"])
        for s in SCHEDULES
    ]
    results = run_ranks(4, train_runs, overrides, timeout=900)
    labels = [f"dp2 pp2 {s} compiled" for s in SCHEDULES]
    _check(results, labels, [references[(2, True)]] * len(SCHEDULES))
