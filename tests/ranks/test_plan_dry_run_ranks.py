"""`mesh3d plan --dry-run`: every distinct rank of 512-rank layouts built as training builds them.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_plan_dry_run.py`."""

import pytest
from test_plan_dry_run import CASES

from mesh3d.plan import make_plan
from mesh3d.plan.dry_run import differences, dry_run


@pytest.mark.parametrize("label", CASES)
def test_dry_run_bytes_equal_the_plan_at_512_ranks(label):
    cfg, count = CASES[label]
    plan, run = make_plan(cfg, 512), dry_run(cfg, 512)
    assert len(run.built) == count, [b.ranks for b in run.built]
    assert sorted(r for b in run.built for r in b.ranks) == list(range(512))
    for b in run.built:
        rp = plan.ranks[b.rank]
        assert b.stages == rp.stages and b.param_elements == rp.param_elements, (label, b.rank)
        assert b.param_bytes == rp.param_bytes and b.grad_bytes == rp.grad_bytes, (label, b.rank)
        assert b.optimizer_bytes == rp.optimizer_bytes, (label, b.rank)
        assert b.schedule.startswith("Schedule") == (plan.dims["pp"] > 1), b.schedule
    assert differences(plan, run) == {}
