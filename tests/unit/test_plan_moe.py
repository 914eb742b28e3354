"""`mesh3d.plan` for mixture of experts: parameters and saved-bytes terms by hand; the
expert-parallel plan by hand (groups, slices, all-to-alls, the expert-replica reduction); real runs
on 2 ranks (dp, zero1, bf16, autocast, pp, tp both modes, cp, ep2 with its recorded routing)
equal the plan's, exactly.

The tests of this subject that need a process group are in `tests/ranks/test_plan_moe_ranks.py`."""

import copy

from plan_measure import (
    ONE_STEP,
    plan_cfg,
)

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.plan import (
    format_plan,
    make_plan,
    stage_activation_bytes,
)


def _moe_cfg(overrides: list[str], base: dict | None = None):
    from test_moe import MOE  # 3 layers, MoE in 0 and 2: 4 experts, top 2, F 32, shared 48

    return apply_overrides(config_from_dict(copy.deepcopy(base or MOE)), overrides)


def test_moe_parameters_total_and_active_by_hand():
    plan = make_plan(_moe_cfg([]))
    h, f, v, dense_ffn, kv = 64, 32, plan.padded_vocab, 128, 4 * 8
    attn = h * h + 2 * h * kv + h * h + 2 * h  # q, k, v, o; the two norms
    router, experts, shared = 4 * h, 4 * 3 * h * f, 3 * h * 48 + h
    dense, moe = attn + 3 * h * dense_ffn, attn + router + experts + shared
    total = 2 * v * h + h + dense + 2 * moe  # untied embedding and lm_head, final norm
    assert plan.total_params == total and plan.ranks[0].param_elements == total
    assert plan.active_params == total - 2 * (4 - 2) * 3 * h * f  # 2 of 4 experts idle
    text = format_plan(plan)
    assert "top 2 of 4 experts of 32, a shared expert of 48 in layers 0,2" in text
    assert f"{plan.active_params:,} parameters active per token of {total:,}" in text
    assert "no expert parallelism" in text
    assert "mixture of experts" not in format_plan(make_plan(plan_cfg([])))


def test_moe_activation_terms_by_hand():
    # MOE, one microbatch of 2 x 16: T 32, h 64, E 4, k 2, F 32, G 48, fp32
    cfg = _moe_cfg(ONE_STEP)
    dense, moe = (stage_activation_bytes(cfg, [i], False, False)[0] for i in (1, 0))
    t, h = 32, 64
    mlp = t * h * 4 + 4 * t * 128 * 4  # a dense MLP's input and intermediates
    router = t * h * 4 + 4 * t * 4 + 8 * t * 2 + 4 * 2 * 4
    routed = 2 * t * (16 + 4 * 32 * 4 + h * 12 + 4) + 4 * 4  # + the grouped GEMMs' int32 offsets
    shared = t * (4 * 48 * 4 + h * 4 + 4)
    assert moe - dense == router + routed + shared - mlp
    assert stage_activation_bytes(cfg, 3, False, False)[0] == 2 * moe + dense


def test_expert_parallel_plan_by_hand():
    # MOE at dp 4, ep 2, one microbatch of 2 x 16 (T 32), h 64, E 4, k 2, F 32, 2 MoE layers
    cfg = _moe_cfg(["parallelism.dp=4", "parallelism.expert_parallel_size=2", *ONE_STEP])
    plan, whole = make_plan(cfg, 4), make_plan(_moe_cfg(["parallelism.dp=4", *ONE_STEP]), 4)
    assert plan.groups["ep"] == [[0, 1], [2, 3]]
    assert plan.groups["expert_replicas"] == [[0, 2], [1, 3]]
    experts = 2 * 4 * 3 * 64 * 32  # both MoE layers' stacked experts, all 4
    rp = plan.ranks[1]
    assert rp.param_elements == whole.ranks[1].param_elements - experts // 2
    assert plan.total_params == whole.total_params
    comm = {c.what: c for c in rp.comm}
    rows = 2 * 32 * 64 * 4  # k·T rows of h, fp32
    counts, there = comm["expert counts (fwd)"], comm["routed rows, results back (fwd)"]
    n = 2 * plan.microbatches  # MoE layers x microbatches
    assert (counts.collective, counts.count, counts.bytes_each) == ("all_to_all", n, 8 * 4)
    assert (there.count, there.bytes_each, there.sent_bytes) == (2 * n, rows, 2 * n * rows // 2)
    assert comm["their grads (bwd)"].count == 2 * n
    dp = next(c for c in rp.comm if c.what.startswith("grads: 1 bucket"))  # zero 0, 25 MiB cap
    rep = comm["expert grads over their replicas (dp/ep = 2)"]
    assert dp.bytes_each == (rp.param_elements - experts // 2) * 4
    assert (rep.axis, rep.bytes_each, rep.sent_bytes) == ("dp", experts // 2 * 4, experts // 2 * 4)
    text = format_plan(plan)
    assert "ep: [0, 1] [2, 3]" in text and "expert replicas: [0, 2] [1, 3]" in text
    assert "balanced routing assumed" in text and "no expert parallelism" not in text
    # dp 2, ep 2: no replica to sum the expert grads over
    two = make_plan(_moe_cfg(["parallelism.dp=2", "parallelism.expert_parallel_size=2"]), 2)
    assert not any("replicas" in c.what for c in two.ranks[0].comm)
    # the all-gather dispatcher: every rank's T tokens, whatever the routing
    ag = make_plan(_moe_cfg(["parallelism.dp=4", "parallelism.expert_parallel_size=2", *ONE_STEP,
                             f"{MOE_KEY}.token_dispatcher_type=allgather"]), 4)  # fmt: skip
    got = {c.what: (c.collective, c.count, c.bytes_each) for c in ag.ranks[1].comm
           if c.axis == "ep"}  # fmt: skip
    tokens = 2 * 32  # ep·T
    assert got == {
        "token counts (fwd)": ("all_gather", n, 8 * 2),
        "chosen experts (fwd)": ("all_gather", n, 8 * 2 * tokens),
        "tokens and weights (fwd)": ("all_gather", n, tokens * (64 + 2) * 4),
        "results (fwd)": ("reduce_scatter", n, tokens * 64 * 4),
        "result grads (bwd)": ("all_gather", n, tokens * 64 * 4),
        "token and weight grads (bwd)": ("reduce_scatter", n, tokens * (64 + 2) * 4),
        "expert grad norm (fp64 squares)": ("all_reduce", 1, 8),
    }, got
    # per MoE block it saves k·T·(h·e_p + 16 - 8·ep) bytes fewer than all-to-all (balanced);
    # the peak holds one microbatch's 2 MoE layers
    fewer = 2 * 2 * 32 * (64 * 4 + 16 - 8 * 2)
    assert rp.saved_activation_bytes - ag.ranks[1].saved_activation_bytes == fewer
    assert "expert parallelism 2 (allgather)" in format_plan(ag)


MOE_KEY = "model.model_config.moe_config"
