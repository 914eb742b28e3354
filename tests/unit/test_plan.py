"""`mesh3d.plan`: groups, stages and bubbles by hand; the CLI; memory numbers against real runs.

- Unit checks: the 2x2x2 rank groups, the cost-based stage split, the bubble closed forms and the
  in-flight microbatches of GPipe / 1F1B.
- The CLI: a report and exit 0; `--json`; a bad world size prints `error: ...`, exits 2, no
  traceback.
- Real runs, 8 forked ranks at (dp, tp, pp) = (2, 2, 2), one launch, several configs: each rank's
  parameter, gradient and optimizer-state bytes equal make_plan's, exactly.
- Activations: saved-for-backward bytes measured with saved-tensor hooks on 2 ranks (pp=2 under
  four schedules, with and without recompute; tp=2 with sequence parallelism) are within 25% of
  the plan's estimate.
Context parallelism: tests/unit/test_plan_cp.py; mixture of experts: tests/unit/test_plan_moe.py.
The measurements inside ranks are in tests/helpers/plan_measure.py.

The tests of this subject that launch real processes are in `tests/launch/test_plan_launch.py`.
The tests of this subject that need a process group are in `tests/ranks/test_plan_ranks.py`."""

import json
import types
from pathlib import Path

import pytest
from parity import layout_overrides
from plan_measure import (
    ONE_STEP,
    PP2,
    plan_cfg,
    pp_schedule,
)

from mesh3d import cli
from mesh3d.mesh import ParallelDims
from mesh3d.plan import (
    _orders,
    bubble,
    format_plan,
    loss_saved_bytes,
    main,
    make_plan,
)

ROOT = Path(__file__).resolve().parents[2]
CPU_TINY = str(ROOT / "recipes/configs/cpu_tiny.yaml")


def test_rank_groups_2x2x2_are_parallel_dims():
    plan = make_plan(plan_cfg(layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + PP2), 8)
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert plan.groups == {axis: dims.groups(axis) for axis in ("tp", "cp", "pp", "dp")}
    assert plan.groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.groups["cp"] == [[r] for r in range(8)]
    assert plan.groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [r.coords for r in plan.ranks] == [dims.coords(r) for r in range(8)]


def test_stage_layers():
    # TINY, 4 layers: decoder cost 4*8*8*64 + 3*128*64 = 40960, lm_head 250*64 = 16000, total
    # 179840. pp=2, thresholds 89920 / 179840: decoder 2 (c=122880) crosses the first one and
    # stays on stage 0.
    plan = make_plan(
        plan_cfg(layout_overrides(1, 1, "ALL_REDUCE", 0, True) + PP2 + pp_schedule("1f1b"))
    )
    got = [(s.stage, s.pp_rank, s.layers, s.embedding, s.head) for s in plan.stages]
    assert got == [(0, 0, [0, 1, 2], True, False), (1, 1, [3], False, True)]
    # 4 stages, thresholds 44960 / 89920 / 134880: [0, 1], [2], [3], [] (the head); V placement
    ov = PP2 + pp_schedule("zbv_zero_bubble", 2) + ["tokens.batch_accumulation_per_replica=4"]
    plan = make_plan(plan_cfg(layout_overrides(1, 1, "ALL_REDUCE", 0, True) + ov))
    got = [(s.stage, s.pp_rank, s.layers, s.embedding, s.head) for s in plan.stages]
    assert got == [
        (0, 0, [0, 1], True, False),
        (1, 1, [2], False, False),
        (2, 1, [3], False, False),
        (3, 0, [], False, True),
    ]
    assert [r.stages for r in plan.ranks] == [[0, 3], [1, 2]]


def test_bubble_formulas():
    assert bubble("afab", 2, 1, 2).fraction == pytest.approx(1 / 3)  # (2-1)/(2+2-1)
    assert bubble("1f1b", 4, 1, 8).fraction == pytest.approx(3 / 11)
    assert bubble("interleaved_1f1b", 4, 2, 8).fraction == pytest.approx(3 / 19)  # 3/(16+3)
    assert bubble("looped_bfs", 4, 2, 8).fraction == pytest.approx(3 / 19)
    zb = bubble("interleaved_zero_bubble", 4, 2, 8)
    assert zb.fraction == pytest.approx(3 / 51) and zb.kind == "exact"  # 3/(3*2*8+3), m >= pp
    # torch's ZBV order replayed with F = I = W = 1 (benchmarks/schedules): each rank idles
    # pp-1 chunk times (once m >= 3pp/2), not the ideal ZB-V's 0
    for pp, m, want in ((2, 4, 1 / 25), (2, 16, 1 / 97), (4, 8, 3 / 51), (4, 32, 3 / 195),
                        (8, 16, 7 / 103), (8, 64, 7 / 391), (4, 4, 6 / 30)):  # fmt: skip
        zbv = bubble("zbv_zero_bubble", pp, 2, m)
        assert zbv.fraction == pytest.approx(want) and zbv.kind == "exact", (pp, m)
    dv = bubble("dualpipev", 4, 2, 8)  # torch's DualPipeV order, F&B one after the other
    assert dv.fraction == pytest.approx(3 / 51) and dv.kind == "exact"
    assert bubble("1f1b", 1, 1, 8).fraction == 0.0


def test_microbatches_in_flight():
    ov = ["parallelism.pp=4", "model.model_config.num_hidden_layers=8"]
    ov += ["tokens.batch_accumulation_per_replica=8", "tokens.micro_batch_size=1"]
    one_f_one_b = make_plan(plan_cfg(ov + pp_schedule("1f1b")))
    assert [r.microbatches_in_flight for r in one_f_one_b.ranks] == [4, 3, 2, 1]  # min(pp-r, m)
    gpipe = make_plan(plan_cfg(ov + pp_schedule("afab")))
    assert [r.microbatches_in_flight for r in gpipe.ranks] == [8] * 4


def test_json_output(capsys):
    main([CPU_TINY, "--json", "parallelism.pp=2", "parallelism.dp=2"])
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and len(data["ranks"]) == 4
    assert data["groups"]["pp"] == [[0, 2], [1, 3]]
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "comm"} <= data["ranks"][0].keys()


def test_cli_dispatches_plan_and_refuses_unknown_commands(capsys):
    cli.main(["plan", CPU_TINY, "--json"])
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plam", CPU_TINY])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'plam'")


# --- real runs: activations saved for backward ------------------------------------------------


def test_split_backward_frees_the_loss_at_input_backward():
    # torch's stage_backward_input detaches the loss, so I (not W) frees what the loss saved;
    # with ZB at pp=2, m=2 rank 1's peak is the second F3, after I3 freed the first's loss
    # (benchmarks/schedules meters it: 36.2 MB, not the 39.0 MB of freeing it all at W)
    m2 = ["tokens.batch_accumulation_per_replica=2"]
    cfg = plan_cfg(PP2[:2] + ONE_STEP + m2 + pp_schedule("interleaved_zero_bubble", 2))
    plan = make_plan(cfg, 2)
    ops = ["F1", "F1", "F3", "I3", "F3", "I3", "W3", "I1", "W3", "I1", "W1", "W1"]
    z = types.SimpleNamespace(pp=2, v=2, m=2, schedule="interleaved_zero_bubble")
    assert [f"{k}{s}" for k, s in _orders(z)[0][1]] == ops
    saved = {s.stage: s.saved_per_microbatch for s in plan.stages}
    want = 2 * saved[1] + 2 * saved[3] - loss_saved_bytes(cfg)
    assert plan.ranks[1].saved_activation_bytes == want


def test_format_plan_lists_every_rank():
    plan = make_plan(
        plan_cfg(layout_overrides(2, 2, "REDUCE_SCATTER", 0, True) + PP2 + pp_schedule("1f1b")), 8
    )
    text = format_plan(plan)
    assert "  0-3    0 " in text and "  4-7    1 " in text  # memory rows: one per pp stage
    assert "ranks 0-3 send" in text and "ranks 4-7 send" in text
    assert "Pipeline bubble: 33.3%" in text  # (2-1)/(2+2-1), 2 microbatches
