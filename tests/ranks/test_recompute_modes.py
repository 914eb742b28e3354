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
