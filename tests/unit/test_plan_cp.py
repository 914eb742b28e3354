"""`mesh3d.plan` under context parallelism: the cp groups and the activation terms at cp 2 by hand;
real runs on 4 ranks (cp with tp, sequence parallelism, dp, FSDP, recompute, bf16 autocast, Qwen2
document masking): params, grads, optimizer state, the calls and bytes of the cp collectives, and
the bytes saved for backward equal the plan's, exactly (saved bytes plus what the plan leaves out
on purpose: CPU SDPA's causal masks, the autocast weight copies it counts as transient).

The tests of this subject that need a process group are in `tests/ranks/test_plan_cp_ranks.py`."""

from plan_measure import (
    ONE_STEP,
    PP2,
    cp_overrides,
    plan_cfg,
)

from mesh3d.mesh import ParallelDims
from mesh3d.plan import (
    loss_saved_bytes,
    make_plan,
    stage_activation_bytes,
)


def test_cp_groups_and_activations_by_hand():
    plan = make_plan(plan_cfg(cp_overrides(2, *PP2[:2], "parallelism.tp=2")), 8)
    dims = ParallelDims(dp=1, tp=2, pp=2, cp=2)
    assert plan.dims == {"pp": 2, "dp": 1, "cp": 2, "tp": 2} and plan.world_size == 8
    assert plan.groups == {axis: dims.groups(axis) for axis in ("tp", "cp", "pp", "dp")}
    assert plan.groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # mesh.py's picture
    assert [r.coords for r in plan.ranks] == [dims.coords(r) for r in range(8)]
    # one layer, fp32, TINY: b 2, s 16, h 64, F 128, 8 heads of 8, 4 kv heads
    one, cp = plan_cfg(ONE_STEP), plan_cfg(cp_overrides(2))
    layer = [stage_activation_bytes(c, 1, False, False)[0] for c in (one, cp)]
    kv = 2 * 2 * 16 * 4 * 8 * 4  # k and v of the whole sequence: the same at cp 2
    attn_out = 2 * 8 * 64 * 4  # under cp the chunks' outputs are concatenated: once more
    rope = [16 * 16 * 8, 16 * 2 * 8 * 8]  # cos/sin of positions 0..s-1, then [b, s/cp] ones
    assert layer[1] == (layer[0] - kv - rope[0]) // 2 + kv + attn_out + rope[1]  # rest: s/cp
    held = [stage_activation_bytes(c, 2, True, True)[1] for c in (one, cp)]
    assert held[1] * 2 == held[0]  # the logits: s/cp tokens
    assert loss_saved_bytes(cp) == (loss_saved_bytes(one) - 4) // 2 + 4


def test_cp_communication_by_hand():
    # TINY at cp 2, dp 2, 2 layers, 4 microbatches of 2 x 16 tokens, recompute
    cfg = plan_cfg(cp_overrides(2, "parallelism.dp=2", "parallelism.recompute_layer=true"))
    rp = make_plan(cfg, 4).ranks[0]
    comm = {(c.axis, c.collective): c for c in rp.comm}
    kv = 2 * 16 * 4 * 8 * 4  # the whole sequence's k (or v): b, s, 4 kv heads of 8, fp32
    gather, scatter = comm["cp", "all_gather"], comm["cp", "reduce_scatter"]
    assert (gather.count, gather.bytes_each) == (2 * 2 * 4 * 2, kv)  # k and v, recompute again
    assert (scatter.count, scatter.bytes_each) == (2 * 2 * 4, kv)
    assert gather.sent_bytes == 32 * kv // 2  # a ring of 2 ranks sends half of each
    grads = comm["dp", "all_reduce"]  # over the 4 ranks of dp x cp, which hold the same params
    assert "1 bucket" in grads.what and "over dp x cp" in grads.what  # zero 0: a 25 MiB bucket
    assert grads.bytes_each == rp.grad_bytes
    assert grads.sent_bytes == round(rp.grad_bytes * 2 * 3 / 4)
    assert [c.axis for c in rp.comm] == ["cp", "cp", "dp"]  # no tp, no pp
