"""Layout parity for tensor and data parallelism: every layout trains the one-process model.

For 5 steps with clipping active and >= 2 microbatches, the loss at every step, the pre-clip
grad norm and the final full weights must equal a one-process run of the same config (fp32,
relative difference <= 1e-5), for (dp, tp) in {(1,2), (1,4), (2,1), (4,1), (2,2)} x tp_mode x
zero_stage x tied/untied embeddings. Layouts are grouped by world size: one launch per size.
"""

import itertools

import pytest
from dist import run_ranks
from parity import layout_overrides, max_rel_diff, train_runs

TOL = 1e-5
MODES = ("ALL_REDUCE", "REDUCE_SCATTER")


def _layouts(world: int) -> list[tuple]:
    out = []
    for dp, tp in [(1, 2), (1, 4), (2, 1), (4, 1), (2, 2)]:
        if dp * tp != world:
            continue
        modes = MODES if tp > 1 else ("ALL_REDUCE",)  # dp-only layouts need not repeat tp modes
        out += [(dp, tp, m, z, t) for m, z, t in itertools.product(modes, (0, 1), (False, True))]
    return out


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    runs = [layout_overrides(1, 1, "ALL_REDUCE", 0, tied) for tied in (False, True)]
    untied, tied = run_ranks(1, train_runs, runs, timeout=120)[0]
    for ref in (untied, tied):
        assert min(ref["grad_norm"]) > 0.05, "clipping must be active in the parity config"
        assert ref["loss"][-1] < ref["loss"][0]
    return {False: untied, True: tied}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_dp_layouts_match_one_process(world, references):
    layouts = _layouts(world)
    results = run_ranks(world, train_runs, [layout_overrides(*lay) for lay in layouts], timeout=300)
    rank0 = results[0]
    table = {lay: max_rel_diff(run, references[lay[4]]) for lay, run in zip(layouts, rank0)}
    report = "\n".join(
        f"dp={d} tp={t} {m} zero={z} tied={ti}: {v:.2e}" for (d, t, m, z, ti), v in table.items()
    )
    print(f"\nparity (max relative difference), world {world}:\n{report}")
    # every rank reports the same (global) loss; replicated parameters (norms under TP, all
    # parameters across dp with zero_stage 0) are bitwise identical on every rank holding them
    for other in results[1:]:
        for a, b in zip(rank0, other):
            assert a["loss"] == b["loss"]
    for r, runs in enumerate(results):
        for lay, run in zip(layouts, runs):
            assert not run["replica_mismatches"], (r, lay, run["replica_mismatches"])
    bad = {k: v for k, v in table.items() if not v <= TOL}
    assert not bad, f"layouts off by more than {TOL}:\n{report}"
