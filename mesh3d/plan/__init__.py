"""Pre-flight plan of a run: `mesh3d plan CONFIG [--world-size N] [--json] [--dry-run]
[key=value ...]` (or `python -m mesh3d.plan ...`).

Prints, for the validated config and without starting any process group: the rank groups, the
layers of each pipeline stage, parameter / gradient / optimizer / activation bytes per rank, the
pipeline bubble, and the communication per step on each mesh axis (tp, cp, pp, and dp, whose
gradient reduction runs over dp x cp: context-parallel ranks hold the same parameters; under
expert parallelism also the ep dispatch (all-to-all or all-gather), and the expert grads'
reduction over the ranks holding the same experts).
`make_plan(cfg, world_size)` returns it as a `Plan` dataclass, `format_plan(plan)` renders it.

Everything comes from the code training runs: `ParallelDims` for the groups, `split_layers`,
`stage_ids_of_rank` and `build_stage` on a meta model for the stages, `llama_tp_plan` for the dim
tensor parallelism shards, `dp_mode` for the dp axis, torch's schedules for the order of
forwards and backwards on each rank. tests/ranks/test_plan_ranks.py compares params, grads and optimizer
state with a real 2x2x2 run, exactly, and activations with saved-tensor hooks;
tests/ranks/test_plan_cp_ranks.py, for context parallelism, activations and the cp collectives with real cp
runs, exactly; tests/ranks/test_plan_moe_ranks.py mixture-of-experts runs (dp, tp, cp, pp, expert
parallelism: its dispatch collectives and saved bytes with the recorded received rows in place
of the balanced expectation) likewise.

Files: `records.py` (the `Plan` dataclasses), `sizes.py` (the numbers read from a config),
`activations.py` (bytes saved per stage and microbatch), `memory.py` (parameters, grads,
optimizer state and transient bytes per rank), `schedule.py` (each rank's order of forwards and
backwards, the microbatches in flight, the bubble), `comm.py` (collectives and sends per step),
`build.py` (`make_plan`), `report.py` (`format_plan`, `format_dry_run`), `dry_run.py` (`--dry-run`:
every distinct rank's parts built as training builds them, on meta with a fake process group,
their bytes against the plan's), `__main__.py` (the command line).
"""

from mesh3d.plan.activations import loss_saved_bytes, stage_activation_bytes
from mesh3d.plan.build import make_plan
from mesh3d.plan.comm import WIRE
from mesh3d.plan.dry_run import differences, dry_run
from mesh3d.plan.records import Bubble, BuiltRank, CommItem, DryRun, Plan, RankPlan, StagePlan
from mesh3d.plan.report import format_dry_run, format_plan
from mesh3d.plan.schedule import _orders, _peaks, bubble  # noqa: F401  (benchmarks/schedules)


def __getattr__(name: str):
    # `main` lives in __main__.py and loads on first use: importing it here would make
    # `python -m mesh3d.plan` run that file twice (runpy warns when it is already imported)
    if name == "main":
        from mesh3d.plan.__main__ import main

        return main
    raise AttributeError(f"module 'mesh3d.plan' has no attribute {name!r}")


__all__ = [
    "Bubble",
    "BuiltRank",
    "CommItem",
    "DryRun",
    "Plan",
    "RankPlan",
    "StagePlan",
    "WIRE",
    "bubble",
    "differences",
    "dry_run",
    "format_dry_run",
    "format_plan",
    "loss_saved_bytes",
    "main",
    "make_plan",
    "stage_activation_bytes",
]
