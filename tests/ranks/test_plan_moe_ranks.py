"""`mesh3d.plan` for mixture of experts: parameters and saved-bytes terms by hand; the
expert-parallel plan by hand (groups, slices, all-to-alls, the expert-replica reduction); real runs
on 2 ranks (dp, zero1, bf16, autocast, pp, tp both modes, cp, ep2 with its recorded routing)
equal the plan's, exactly.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_plan_moe.py`."""

import torch
from dist import run_ranks
from plan_measure import (
    ONE_STEP,
    cp_measured,
    cp_overrides,
    cpu_causal_masks,
    pp_schedule,
)
from test_plan_moe import MOE_KEY, _moe_cfg
from torch import nn

from mesh3d.plan import (
    make_plan,
)
from mesh3d.plan.activations import moe_routed_bytes
from mesh3d.plan.sizes import _Sizes


def _moe_measured(rank: int, world: int, runs: list) -> list[dict]:
    """`cp_measured` without the cp counters, plus the routed rows per microbatch and layer,
    and under expert parallelism, per run: the rows each dispatch received (R), and per dtype
    the calls and send-buffer bytes of `all_to_all_single` (counts int64, rows float)."""
    import torch.distributed as dist

    import mesh3d.parallel.experts as experts
    from mesh3d.models.moe import MoE

    routed: list[set[int]] = [set() for _ in runs]
    received: list[list[int]] = [[] for _ in runs]
    ran: list[list[int]] = [[] for _ in runs]
    a2a: list[dict] = [{} for _ in runs]
    flat: list[dict] = [{} for _ in runs]
    run = [0]

    def count_rows(module, args, output):
        with torch.no_grad():  # nothing saved: the meter must not see it
            _, _, experts_ = module.route(args[0])
        routed[run[0]].add(experts_.numel())

    def all_to_all(x, send, recv, group, fn=experts.all_to_all):
        calls = received[run[0]]
        calls.append(sum(recv))
        return fn(x, send, recv, group)

    def all_to_all_single(out, inp, *args, fn=dist.all_to_all_single, **kwargs):
        key = str(inp.dtype)
        calls, nbytes = a2a[run[0]].get(key, (0, 0))
        a2a[run[0]][key] = (calls + 1, nbytes + inp.numel() * inp.element_size())
        return fn(out, inp, *args, **kwargs)

    def gather_and_reduce(experts_fn, *args, fn=experts.gather_and_reduce):
        def counted(rows, counts):
            ran[run[0]].append(len(rows))
            return experts_fn(rows, counts)

        return fn(counted, *args)

    def flat_collective(kind, fn):
        def wrapped(out, inp, group=None):
            full = out if kind == "all_gather" else inp
            key = f"{kind} {full.dtype}"
            calls, nbytes = flat[run[0]].get(key, (0, 0))
            flat[run[0]][key] = (calls + 1, nbytes + full.numel() * full.element_size())
            return fn(out, inp, group=group)

        return wrapped

    hook = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: count_rows(m, a, o) if isinstance(m, MoE) else None
    )
    names = ("all_to_all", "gather_and_reduce", "all_gather_flat", "reduce_scatter_flat")
    patched = [getattr(experts, n) for n in names] + [dist.all_to_all_single]
    experts.all_to_all, experts.gather_and_reduce = all_to_all, gather_and_reduce
    experts.all_gather_flat = flat_collective("all_gather", patched[2])
    experts.reduce_scatter_flat = flat_collective("reduce_scatter", patched[3])
    dist.all_to_all_single = all_to_all_single
    out = []
    try:
        for i, cfg in enumerate(runs):
            run[0] = i
            out += cp_measured(rank, world, [cfg])
    finally:
        hook.remove()
        for n, fn in zip(names, patched):
            setattr(experts, n, fn)
        dist.all_to_all_single = patched[-1]
    for o, rows, rows_ran, calls, flats, k in zip(out, received, ran, a2a, flat, routed):
        o["routed"] = k
        # all-to-all: dispatch, then results back (whose recv is what was sent); all-gather:
        # the rows the local experts ran
        o["received"] = rows[::2] or rows_ran
        o["a2a"], o["flat"] = calls, flats
    return out


ALLGATHER = f"{MOE_KEY}.token_dispatcher_type=allgather"


RUNS_MOE = {  # on 2 ranks; label -> (config overrides, base)
    "moe dp2 zero0": ["parallelism.dp=2", *ONE_STEP],
    "moe dp2 zero1 tied": ["parallelism.dp=2", "optimizer.zero_stage=1", *ONE_STEP,
                           "model.model_config.tie_word_embeddings=true"],
    "moe dp2 bf16 autocast": ["parallelism.dp=2", "model.dtype=bfloat16", *ONE_STEP],
    "moe dp2 bf16 params": ["parallelism.dp=2", "model.dtype=bfloat16", *ONE_STEP,
                            "optimizer.accumulate_grad_in_fp32=false"],
    "moe pp2 1f1b": ["parallelism.pp=2", *ONE_STEP, "tokens.batch_accumulation_per_replica=4",
                     *pp_schedule("1f1b")],
    "dense pp2 1f1b": ["parallelism.pp=2", *ONE_STEP, "tokens.batch_accumulation_per_replica=4",
                       *pp_schedule("1f1b"), "model.model_config.moe_config=null"],
    "moe dp2 ep2": ["parallelism.dp=2", "parallelism.expert_parallel_size=2", *ONE_STEP,
                    "tokens.batch_accumulation_per_replica=2"],
    "moe dp2 ep2 bf16 autocast": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                  "model.dtype=bfloat16", *ONE_STEP],
    "moe dp2 ep2 bf16 params": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                "model.dtype=bfloat16", "optimizer.accumulate_grad_in_fp32=false",
                                *ONE_STEP],
    "moe dp2 ep2 allgather": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                              *ONE_STEP, "tokens.batch_accumulation_per_replica=2", ALLGATHER],
    "moe dp2 ep2 allgather bf16 autocast": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                            "model.dtype=bfloat16", *ONE_STEP, ALLGATHER],
    "moe dp2 ep2 allgather bf16 params": ["parallelism.dp=2", "parallelism.expert_parallel_size=2",
                                          "model.dtype=bfloat16", *ONE_STEP, ALLGATHER,
                                          "optimizer.accumulate_grad_in_fp32=false"],
    "moe tp2 sequence parallel": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER",
                                  *ONE_STEP],
    "moe tp2 all-reduce": ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE", *ONE_STEP],
    "moe cp2": cp_overrides(2),
}  # fmt: skip


def test_plan_equals_real_moe_runs():
    """Params, grads and optimizer state exactly (router, stacked experts, shared expert, dense
    MLPs elsewhere). The bytes saved for backward exactly without a pipeline in fp32 and bf16
    params: the experts' rows add up to k·T whatever the routing (checked: every microbatch of
    every MoE layer routed k·T rows), and every saved tensor is linear in them. Under autocast,
    plus the cached weight casts the plan counts as transient, exactly too (every expert got
    tokens: the plan's bound is met). With a pipeline, the MoE run misses exactly what the same
    dense run misses (the few bytes per microbatch a schedule keeps that the plan leaves out).
    Under tp (both modes) and cp the block runs on the rank's tokens: exact too (cp plus CPU
    SDPA's causal masks). Under expert parallelism the plan assumes balanced routing: the run's
    recorded received rows replace it (`_ep_checks`), then the saved bytes and the all-to-all
    calls and bytes are exact (fp32, bf16 params, bf16 autocast); the same with the all-gather
    dispatcher, whose collectives are exact without the recorded rows."""
    cfgs = [_moe_cfg(ov) for ov in RUNS_MOE.values()]
    measured = run_ranks(2, _moe_measured, cfgs, timeout=300)
    off = {}
    for i, (label, cfg) in enumerate(zip(RUNS_MOE, cfgs)):
        plan, z = make_plan(cfg, 2), _Sizes.of(cfg)
        for rank, rp in enumerate(plan.ranks):
            got = measured[rank][i]
            if z.moe_layers:  # k·T in every MoE forward (T: the tokens the block runs on)
                assert got["routed"] == {z.top_k * z.local_tokens}, (label, got["routed"])
            want = dict(elements=rp.param_elements, params=rp.param_bytes,
                        grads=rp.grad_bytes, optim=rp.optimizer_bytes)  # fmt: skip
            assert {k: got[k] for k in want} == want, f"{label}, rank {rank}"
            saved = rp.saved_activation_bytes + rp.transient.get("autocast_weight_copies", 0)
            if z.cp > 1:
                saved += cpu_causal_masks(cfg, rp.coords["cp"], z.e_c)
            saved += _ep_checks(z, rp, got, label)
            if plan.dims["pp"] == 1:
                assert got["saved"] == saved, f"{label}, rank {rank}"
            else:
                off.setdefault(rank, []).append(got["saved"] - saved)
    assert all(len(set(d)) == 1 for d in off.values()), off  # moe and dense pp2 miss the same


def _ep_checks(z, rp, got: dict, label: str) -> int:
    """Under expert parallelism: the dispatch collectives' calls and bytes against the plan's:
    all-to-all with the recorded received rows R in place of the balanced k·T (a rank sends
    k·T rows and R results back in forward, the grads of both in backward), all-gather exactly
    (its sizes do not depend on the routing); returns what the plan's saved bytes lack for the
    recorded R (rows received, or run by the local experts under all-gather; the largest over
    the step's microbatches, as the peak is)."""
    if z.ep == 1:
        assert not got["a2a"] and not got["flat"], label
        return 0
    rows, per_mb = got["received"], len(z.moe_layers)
    assert len(rows) == z.m * per_mb, label
    comm = {c.what: c for c in rp.comm if c.axis == "ep"}
    float_dtype = str(getattr(torch, {4: "float32", 2: "bfloat16"}[z.e_p]))
    if z.dispatcher == "allgather":  # exact whatever the routing
        assert not got["a2a"], label
        planned = {}
        for c in comm.values():
            if c.collective == "all_reduce":
                continue
            ints = c.what.startswith(("token counts", "chosen experts"))
            key = f"{c.collective} {'torch.int64' if ints else float_dtype}"
            calls, nbytes = planned.get(key, (0, 0))
            planned[key] = (calls + c.count, nbytes + c.count * c.bytes_each)
        assert got["flat"] == planned, (label, got["flat"], planned)
    else:
        assert not got["flat"], label
        _a2a_checks(z, comm, got, rows, label, float_dtype)
    base = moe_routed_bytes(z)
    return max(
        sum(moe_routed_bytes(z, r) - base for r in rows[j : j + per_mb])
        for j in range(0, len(rows), per_mb)
    )


def _a2a_checks(z, comm: dict, got: dict, rows: list[int], label: str, float_dtype: str) -> None:
    """The all-to-all calls and bytes against the plan's, with the recorded received rows."""
    kt = z.top_k * z.local_tokens
    counts, sent = comm["expert counts (fwd)"], comm["routed rows, results back (fwd)"]
    grads = comm["their grads (bwd)"]
    assert got["a2a"]["torch.int64"] == (counts.count, counts.count * 8 * z.experts), label
    planned = (sent.count + grads.count) * sent.bytes_each
    skew = 2 * sum(r - kt for r in rows) * z.h * z.e_p  # the R-row halves, routing-dependent
    assert got["a2a"][float_dtype] == (sent.count + grads.count, planned + skew), label
