"""zero_stage 0's bucketed gradient sum (`parallel/buckets.py`), on forked gloo ranks.

- On a plain model at dp 2: three microbatches, buckets of several caps; the gradients equal
  the flat all-reduce's bitwise, every bucket was launched from the backward's hooks (so it
  overlapped), and the extra memory is `in_flight` x the largest bucket.
- Inside training (`Run`) at dp2 and at dp2 x pp2 (1f1b): the run's buckets are launched during
  the backward, all of them, at each step, and each rank has as many as `mesh3d plan` shows.
"""

import copy

import torch
from dist import run_ranks
from parity import TINY, layout_overrides

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.parallel.buckets import GradBuckets, bucket_params
from mesh3d.parallel.data import allreduce_param_grads


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)], torch.nn.Linear(32, 3))


def _backward(model, rank, n):
    for i in range(n):
        torch.manual_seed(100 * rank + i)
        model(torch.randn(5, 32)).square().mean().backward()


def _plain(rank, world):
    import torch.distributed as dist

    out = {}
    for cap in (0, 4096, 10**9):
        flat, bucketed = _model(), _model()
        _backward(flat, rank, 3)
        allreduce_param_grads(list(flat.parameters()), dist.group.WORLD)
        reducer = GradBuckets(list(bucketed.parameters()), dist.group.WORLD, cap)
        reducer.begin(3)
        _backward(bucketed, rank, 3)
        hooked = reducer.launched_in_backward
        reducer.finish()
        same = all(torch.equal(a.grad, b.grad)
                   for a, b in zip(flat.parameters(), bucketed.parameters()))  # fmt: skip
        multi = [sum(p.numel() * 4 for p in b) for b in reducer.buckets if len(b) > 1]
        out[cap] = (
            same,
            hooked,
            len(reducer.buckets),
            reducer.buffer_bytes == 2 * max(multi, default=0),
        )
    return out


def test_buckets_equal_the_flat_all_reduce_and_launch_in_backward():
    for result in run_ranks(2, _plain, timeout=120):
        assert result[0] == (True, 10, 10, True)  # one parameter per bucket
        assert result[4096] == (True, result[4096][2], result[4096][2], True)
        assert 2 < result[4096][2] < 10
        assert result[10**9] == (True, 1, 1, True)  # one bucket: launched by the last hook


def test_bucket_order_is_backward_order_and_cap_holds():
    params = list(_model().parameters())
    buckets = bucket_params(params, 33 * 32 * 4)
    assert [p for b in buckets for p in b] == params[::-1]
    assert all(sum(p.numel() * 4 for p in b) <= 33 * 32 * 4 or len(b) == 1 for b in buckets)


def _in_training(rank, world, overrides):
    from mesh3d.train.run import Run

    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
    run = Run.prepare(cfg)
    seen = []
    for step in (1, 2):
        run.step(step)
        seen.append([(r.launched_in_backward, len(r.buckets)) for r in run.parts.reducers])
    return seen


def _planned(overrides, world) -> list[int]:
    """Each rank's bucket count as `mesh3d plan` shows it (its zero 0 dp rows)."""
    from mesh3d.plan import make_plan

    plan = make_plan(apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides), world)
    return [sum(c.count for c in r.comm if c.what.startswith("grads:")) for r in plan.ranks]


def test_training_launches_every_bucket_during_the_backward():
    """...and as many buckets as `mesh3d plan` shows, on every rank."""
    dp2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ["model.ddp_bucket_cap_mb=0"]
    for rank, seen in enumerate(run_ranks(2, _in_training, dp2, timeout=200)):
        assert len(seen[0]) == 1 and seen[0][0][1] > 5
        assert all(launched == n for step in seen for launched, n in step), seen
        assert _planned(dp2, 2)[rank] == seen[0][0][1]
    pp2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ["parallelism.pp=2"]
    for rank, seen in enumerate(run_ranks(4, _in_training, pp2, timeout=200)):
        assert all(launched == n and n >= 1 for step in seen for launched, n in step), seen
        assert _planned(pp2, 4)[rank] == sum(n for _, n in seen[0])
