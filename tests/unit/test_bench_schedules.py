"""benchmarks/schedules: the simulator against the closed forms, and a `--tiny` run's outputs.

- Unit: replaying torch's action tables with uniform costs gives exactly `mesh3d.plan.bubble`'s
  closed forms for afab, 1f1b, interleaved_1f1b and looped_bfs (any pp, m; F = B and F != B), and
  the zero-bubble schedules' (interleaved, ZBV, DualPipeV) with F = I = W; 1F1B's step is
  (m + pp - 1)(F + B); an order that cannot finish raises.
- End to end: `python benchmarks/schedules --tiny --out DIR` (2 forked ranks, a tiny model)
  exits 0 and writes the JSON (keys, bubbles in [0, 1), timelines), the markdown tables (a row
  per schedule) and a PNG.

The tests of this subject that launch real processes are in
`tests/launch/test_bench_schedules_launch.py`."""

import sys
from pathlib import Path

import pytest

from mesh3d.plan import bubble

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/schedules"  # a package: `python benchmarks/schedules` runs __main__.py
CLOSED_FORMS = ("afab", "1f1b", "interleaved_1f1b", "looped_bfs")
# closed forms for F = I = W only
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def _simulator():
    if str(SCRIPT.parent) not in sys.path:  # as when the benchmark runs: benchmarks/ on sys.path
        sys.path.insert(0, str(SCRIPT.parent))
    from schedules import sim

    return sim


bench = _simulator()


@pytest.mark.parametrize("schedule", CLOSED_FORMS)
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_simulated_bubble_equals_closed_form(schedule, pp):
    v = bench.virtual_stages(schedule)
    for m in (pp, 2 * pp, 4 * pp):
        table = bench.action_table(schedule, pp, v, m)
        want = bubble(schedule, pp, v, m).fraction
        for costs in (bench.UNIT, {"F": 1.0, "B": 1.0}, {"F": 1.0, "B": 3.0}):
            got = bench.simulate(table, lambda k, s, c=costs: c[k]).bubble
            assert got == pytest.approx(want, abs=1e-12), (schedule, pp, m, costs)


@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zero_bubble_with_equal_f_i_w_matches_its_formula(schedule, pp):
    for m in (pp, 2 * pp, 4 * pp, 8 * pp)[schedule == "dualpipev" :]:  # DualPipeV: m >= 2pp
        table = bench.action_table(schedule, pp, 2, m)
        got = bench.simulate(table, lambda k, s: bench.UNIT[k]).bubble
        assert got == pytest.approx(bubble(schedule, pp, 2, m).fraction, abs=1e-12), (pp, m)


def test_1f1b_step_and_timeline():
    pp, m, f, b = 4, 8, 1.0, 2.0
    tl = bench.simulate(bench.action_table("1f1b", pp, 1, m), lambda k, s: {"F": f, "B": b}[k])
    assert tl.step == pytest.approx((m + pp - 1) * (f + b))
    for r, events in tl.events.items():
        assert len(events) == 2 * m and all(e[3] < e[4] for e in events)
        assert all(a[4] <= c[3] for a, c in zip(events, events[1:])), r  # one action at a time
    first_b = {r: next(e for e in evs if e[0] == "B") for r, evs in tl.events.items()}
    assert first_b[pp - 1][3] == pytest.approx(pp * f)  # last rank: B0 right after its F0


def test_simulator_refuses_a_table_that_cannot_finish():
    table = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
    with pytest.raises(RuntimeError, match="cannot finish"):
        bench.simulate(table, lambda k, s: 1.0)
