"""`mesh3d.recompute` (selective, full) and `recompute_every`: the same training at any layout.

One process: none, selective and full every 2nd layer give bitwise the same losses (recompute
changes what is saved, never the math). One 8-rank launch at dp2 x tp2 x pp2 (sequence
parallel, 1f1b, zero 0): selective and every-2nd-layer runs equal one process within 1e-5.
"""

from dist import run_ranks
from parity import layout_overrides, train_runs

BASE = ["tokens.train_steps=3", "model.model_config.num_hidden_layers=4"]
MODES = [["mesh3d.recompute=selective"], ["mesh3d.recompute=full", "mesh3d.recompute_every=2"]]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_recompute_modes_train_alike_at_any_layout():
    one = run_ranks(1, train_runs, [BASE] + [BASE + m for m in MODES], timeout=300)[0]
    plain = one[0]
    for run in one[1:]:
        assert run["loss"] == plain["loss"] and run["grad_norm"] == plain["grad_norm"]
    layout = layout_overrides(2, 2, "REDUCE_SCATTER", 0, False) + ["parallelism.pp=2"]
    eight = run_ranks(8, train_runs, [layout + BASE + m for m in MODES], timeout=600)[0]
    for run in eight:
        assert _rel(run["loss"], plain["loss"]) <= 1e-5, (run["loss"], plain["loss"])
        assert _rel(run["grad_norm"], plain["grad_norm"]) <= 1e-5


def test_selective_recompute_with_fsdp_cp_experts_and_compile():
    from test_moe import MOE

    sel = ["mesh3d.recompute=selective"]
    cp2 = ["parallelism.context_parallel_size=2"]
    one = run_ranks(1, train_runs, [BASE, BASE + sel + ["mesh3d.compile=true"]], timeout=600)[0]
    assert _rel(one[1]["loss"], one[0]["loss"]) <= 1e-5  # compiled blocks inside selective
    four = run_ranks(4, train_runs, [
        layout_overrides(2, 1, "ALL_REDUCE", 1, False) + cp2 + BASE + sel,  # FSDP (zero 1), cp
        layout_overrides(2, 1, "ALL_REDUCE", 1, False) + ["mesh3d.full_shard=true", "parallelism.pp=2"]
        + BASE + sel + ["mesh3d.recompute_every=2"],
    ], timeout=600)[0]  # fmt: skip
    for run in four:
        assert _rel(run["loss"], one[0]["loss"]) <= 1e-5, (run["loss"], one[0]["loss"])
    moe_base = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + ["tokens.train_steps=3"]
    ref = run_ranks(1, train_runs, [moe_base], MOE, timeout=300)[0][0]
    ep = layout_overrides(2, 1, "ALL_REDUCE", 0, False) + ["parallelism.expert_parallel_size=2",
                                                            "tokens.train_steps=3"] + sel  # fmt: skip
    got = run_ranks(2, train_runs, [ep], MOE, timeout=300)[0][0]
    assert _rel(got["loss"], ref["loss"]) <= 1e-5, (got["loss"], ref["loss"])
