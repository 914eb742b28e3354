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
    "pp2 1f1b m4 recompute every 2": PP2_M4
    + pp_schedule("1f1b")
    + ["mesh3d.recompute=full", "mesh3d.recompute_every=2"],
    "tp2 sequence parallel": ONE_STEP
    + [
        "parallelism.tp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "tokens.batch_accumulation_per_replica=2",
    ],
}


def _within_a_quarter(runs: dict, measured: list) -> None:
    """Each rank's measured saved bytes of each run (`measured[rank][i]`) within 25% of the
    plan's; the table printed."""
    report, bad = [], []
    for i, (label, overrides) in enumerate(runs.items()):
        plan = make_plan(plan_cfg(overrides), 2)
        for rank, rp in enumerate(plan.ranks):
            got, want = measured[rank][i], rp.saved_activation_bytes
            diff = got / want - 1
            report.append(f"{label} rank {rank}: measured {got}, planned {want} ({diff:+.2%})")
            if abs(diff) > 0.25:
                bad.append(report[-1])
    print("\n" + "\n".join(report))
    assert not bad, "\n".join(bad)


def test_activation_estimate_matches_saved_tensors():
    measured = run_ranks(2, saved_peaks, list(RUNS_ACTIVATIONS.values()), timeout=120)
    _within_a_quarter(RUNS_ACTIVATIONS, measured)


ONE_MB = ONE_STEP + ["tokens.batch_accumulation_per_replica=1", "mesh3d.recompute=selective"]
RUNS_SELECTIVE = {  # on 2 ranks; one microbatch per step, so the kept outputs peak once
    "selective dp2": ONE_MB + ["parallelism.dp=2", "model.model_config.num_hidden_layers=4"],
    "selective every 2 dp2": ONE_MB
    + ["parallelism.dp=2", "mesh3d.recompute_every=2", "model.model_config.num_hidden_layers=4"],
    "selective tp2 sequence parallel": ONE_MB
    + ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
}


def _selective_saved(rank, world, runs):
    """Inside a rank: the saved-tensor peak (`saved_peaks`: layer inputs, the head's tensors)
    plus what selective recompute keeps: the outputs of the kept ops run inside a wrapped
    decoder layer during the training forward (not its recomputation in backward)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import mesh3d.parallel.parallelize as parallelize
    from mesh3d.train import build

    class Kept(TorchDispatchMode):
        inside, total = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.inside and func in parallelize._KEPT_OPS:
                self.total += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                  if isinstance(t, torch.Tensor))  # fmt: skip
            return out

    kept, real = Kept(), build.parallelize

    def counting(model, *a, **k):  # hooks on the wrappers: they run in the training forward only
        model = real(model, *a, **k)
        for layer in model.layers.values():
            if type(layer).__name__ == "CheckpointWrapper":
                layer.register_forward_pre_hook(lambda *_: setattr(kept, "inside", 1))
                layer.register_forward_hook(lambda *_: setattr(kept, "inside", 0))
        return model

    build.parallelize = counting
    out = []
    try:
        for overrides in runs:
            kept.total = 0
            with kept:
                peak = saved_peaks(rank, world, [overrides])[0]
            out.append(peak + kept.total)
    finally:
        build.parallelize = real
    return out


def test_selective_recompute_estimate_matches_what_is_kept():
    measured = run_ranks(2, _selective_saved, list(RUNS_SELECTIVE.values()), timeout=180)
    _within_a_quarter(RUNS_SELECTIVE, measured)
