"""What one rank sends per step on each mesh axis, and how many bytes that puts on the wire."""

from __future__ import annotations

from mesh3d.parallel.buckets import cut
from mesh3d.parallel.pipeline_layout import schedule
from mesh3d.plan.memory import _Param
from mesh3d.plan.records import CommItem, StagePlan
from mesh3d.plan.sizes import _Sizes

# bytes one rank sends per byte of payload, ring algorithms over n ranks
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
WIRE |= {"reduce_scatter": WIRE["all_gather"], "send": lambda n: 1.0}
WIRE["all_to_all"] = WIRE["all_gather"]  # a rank keeps its own share: balanced splits assumed


def _comm(
    z: _Sizes, stages: list[StagePlan], params: list[_Param], tied_peer: bool,
    split: list[int] | None = None,
):  # fmt: skip
    """What one rank sends per step on each axis; payloads in the dtype that travels. `split`:
    how many of `params` each stage module holds, in order (zero 0 buckets each apart)."""
    m, tokens, h = z.m, z.tokens, z.h
    layers = sum(len(s.layers) for s in stages)
    rerun = sum(z.recomputed(i) for s in stages for i in s.layers)  # recompute reruns forwards
    emb, head = m * any(s.embedding for s in stages), m * any(s.head for s in stages)
    fwd, bwd = 2 * (layers + rerun) * m, 2 * layers * m
    r, c = tokens * h * z.e_p, tokens * h * z.e_c  # residual / norm outputs, linear outputs
    if z.sp:
        norms = sum(p.local for p in params if "norm" in p.name) * z.e_p
        tp = [("norm outputs into q/k/v, gate/up (fwd)", "all_gather", fwd, r),
              ("o_proj, down_proj outputs (fwd)", "reduce_scatter", fwd, c),
              ("o_proj, down_proj output grads (bwd)", "all_gather", bwd, c),
              ("norm output grads (bwd)", "reduce_scatter", bwd, r),
              ("embedding output (fwd)", "reduce_scatter", emb, r),
              ("embedding output grad (bwd)", "all_gather", emb, r),
              ("lm_head input (fwd)", "all_gather", head, r),
              ("lm_head input grad (bwd)", "reduce_scatter", head, r),
              ("norm weight grads", "all_reduce", 1, norms)]  # fmt: skip
    else:
        tp = [("o_proj, down_proj outputs (fwd)", "all_reduce", fwd, c),
              ("attention, MLP input grads (bwd)", "all_reduce", bwd, r),
              ("embedding output (fwd)", "all_reduce", emb, r),
              ("lm_head input grad (bwd)", "all_reduce", head, r)]  # fmt: skip
    # the vocab-parallel cross-entropy (train/loss.py): the row max, then the sum of exponentials
    # and the target logit together (compiled code and z-loss: loss_parallel's three all-reduces)
    tp += [("loss: row max (fwd)", "all_reduce", head, 4 * tokens),
           ("loss: sum of exp, target logit (fwd)", "all_reduce", head, 8 * tokens)]  # fmt: skip
    last = z.pp * z.v - 1
    sends = m * sum((s.stage != last) + (s.stage != 0) for s in stages)
    pp = [("activations (fwd), their grads (bwd)", "send", sends, z.local_tokens * h * z.e_p)]
    if tied_peer:
        tied = next(p.grad for p in params if p.name in ("embed_tokens.weight", "lm_head.weight"))
        pp.append(("tied embedding grad", "send", 1, tied * z.e_p))
    # cp: each layer's k and v, gathered from every cp rank (all-gather in forward, and again
    # when recompute reruns it; a reduce-scatter of their grads in backward)
    kv = z.b * z.s * (z.kv_heads * (z.h // z.heads) // z.tp) * z.e_c  # whole sequence's k (or v)
    cp = [("k, v of every layer (fwd)", "all_gather", fwd, kv),
          ("k, v grads (bwd)", "reduce_scatter", bwd, kv)]  # fmt: skip
    if z.docs:  # document ids need every position (int64, no gradient)
        cp.append(("positions (fwd)", "all_gather", fwd // 2, 8 * z.b * z.s))
    # dp: over the flattened dp x cp group, which holds the same parameters
    over = " over dp x cp" if z.cp > 1 else ""
    ep = _ep(z, stages, params)
    if z.mode == "replicate":
        dp = _buckets(z, params, split or [len(params)], over)
    else:  # FSDP2: all units of the rank together; the pipeline defers reduce (and reshard)
        many = m if z.pp == 1 else 1
        gathers = 2 * m if z.mode == "full" else many  # full with pp > 1: a bound
        gathered = sum(p.gathered for p in params) * z.e_p  # expert slices: 0, not FSDP's
        if z.dp_shard:
            over = f" in HSDP groups of {z.shards}"
        dp = [(f"parameters (FSDP unshard){over}", "all_gather", gathers, gathered, z.shards),
              (f"grads{over}", "reduce_scatter", many,
               sum(p.gathered for p in params if p.trains) * z.e_p, z.shards)]  # fmt: skip
        if z.replica_groups > 1:  # HSDP: each shard's gradient summed over the groups
            dp.append((f"grad shards across {z.replica_groups} replica groups", "all_reduce", many,
                       sum(p.grad for p in params if not p.expert) * z.e_p, z.replica_groups))  # fmt: skip
    experts = sum(p.grad for p in params if p.expert) * z.e_p  # summed apart in either mode
    who = f"dp/ep x cp = {z.expert_replicas}" if z.cp > 1 else f"dp/ep = {z.expert_replicas}"
    dp.append((f"expert grads over their replicas ({who})", "all_reduce", 1, experts,
               z.expert_replicas))  # fmt: skip
    items = []
    for axis, rows, size in (("tp", tp, z.tp), ("cp", cp, z.cp), ("pp", pp, z.pp),
                             ("ep", ep, z.ep), ("dp", dp, z.replicas)):  # fmt: skip
        for what, kind, count, each, *more in rows:
            n = more[0] if more and more[0] else size
            if count and each and n > 1:
                sent = round(count * each * WIRE[kind](n))
                overlaps = len(more) > 1 and more[1]
                items.append(CommItem(axis, what, kind, count, each, sent, overlaps))
    return items


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def bucket_sizes(z: _Sizes, params: list[_Param], split: list[int]) -> list[list[int]]:
    """zero 0's gradient buckets of each stage module, bytes each, in launch (backward) order:
    `parallel/buckets.cut` over the module's non-expert parameters, as `GradBuckets` cuts."""
    out, start = [], 0
    for n in split:
        sizes = [p.tp_local * z.e_p for p in params[start : start + n] if not p.expert and p.trains]
        out.append([sum(sizes[i] for i in b) for b in cut(sizes, z.bucket_cap)])
        start += n
    return out


def _buckets(z: _Sizes, params: list[_Param], split: list[int], over: str) -> list[tuple]:
    """Rows of zero 0's gradient all-reduce (`parallel/buckets.py`): during the last
    microbatch's backward a bucket goes out as soon as its gradients are final, so all but each
    module's last bucket (its first parameters: final when its backward ends) overlap with the
    backward; under a zero-bubble schedule the weight gradients bypass the hooks: all after it."""
    modules = [b for b in bucket_sizes(z, params, split) if b]
    every = [x for b in modules for x in b]
    if not every:
        return []
    cap = f"ddp_bucket_cap_mb {z.bucket_cap // 2**20}" if z.bucket_cap else "one per param"
    n, span = len(every), f"{_size(min(every))}-{_size(max(every))}"
    if z.pp > 1 and schedule(z.schedule).zero_bubble:  # weight passes bypass the hooks
        return [(f"grads: {n} buckets ({cap}; {span}){over}, after the backward (zero-bubble "
                 "weight passes), exposed", "all_reduce", n, round(sum(every) / n))]  # fmt: skip
    inside = [x for b in modules for x in b[:-1]]
    last = [b[-1] for b in modules]
    rows = []
    if inside:
        span = f"{_size(min(inside))}-{_size(max(inside))}"
        rows.append((f"grads: {len(inside)} of {n} buckets ({cap}; {span}){over} during the "
                     "last backward, overlapped", "all_reduce", len(inside),
                     round(sum(inside) / len(inside)), 0, True))  # fmt: skip
    sizes = ", ".join(map(_size, last))
    which = f"the last bucket{'s' * (len(last) > 1)} of {n} ({sizes})" if inside else (
        f"1 bucket ({cap}; {sizes})")  # fmt: skip
    rows.append((f"grads: {which}{over}, after the backward, "
                 "exposed", "all_reduce", len(last), round(sum(last) / len(last))))  # fmt: skip
    return rows


def _ep(z: _Sizes, stages: list[StagePlan], params: list[_Param]) -> list[tuple]:
    """Expert parallelism (`parallel/experts.py`), per MoE layer and microbatch, T the block's
    tokens, payloads in x's dtype (the param dtype); recompute reruns the forward ones.

    all-to-all: forward, the expert counts (E int64) and the rows there and back (k·T rows of
    h); backward, the two row all-to-alls reversed. A rank sends exactly k·T rows; what it
    receives, and so the results it sends back, depends on the routing: k·T on average
    (balanced routing assumed), as are the splits the wire bytes assume.
    all-gather: forward, the token counts (int64), the chosen experts (ep·T·k int64), the tokens
    with their k weights (ep·T rows of h + k) and the reduce-scatter of the results (ep·T rows
    of h); backward, an all-gather of the result grads and a reduce-scatter of the token and
    weight grads. Exact, whatever the routing.
    Once per step, the expert grads' squared norm (fp64) over the ep group."""
    if z.ep == 1:
        return []
    moe = sum(i in z.moe_layers for s in stages for i in s.layers)
    rerun = sum(i in z.moe_layers and z.recomputed(i) for s in stages for i in s.layers)
    fwd, bwd = (moe + rerun) * z.m, moe * z.m
    norm = ("expert grad norm (fp64 squares)", "all_reduce", int(any(p.expert for p in params)), 8)
    if z.dispatcher == "allgather":
        rows, k = z.ep * z.local_tokens, z.top_k  # every rank's tokens
        return [("token counts (fwd)", "all_gather", fwd, 8 * z.ep),
                ("chosen experts (fwd)", "all_gather", fwd, 8 * k * rows),
                ("tokens and weights (fwd)", "all_gather", fwd, rows * (z.h + k) * z.e_p),
                ("results (fwd)", "reduce_scatter", fwd, rows * z.h * z.e_p),
                ("result grads (bwd)", "all_gather", bwd, rows * z.h * z.e_p),
                ("token and weight grads (bwd)", "reduce_scatter", bwd, rows * (z.h + k) * z.e_p),
                norm]  # fmt: skip
    rows = z.top_k * z.local_tokens * z.h * z.e_p
    return [("expert counts (fwd)", "all_to_all", fwd, 8 * z.experts),
            ("routed rows, results back (fwd)", "all_to_all", 2 * fwd, rows),
            ("their grads (bwd)", "all_to_all", 2 * bwd, rows),
            norm]  # fmt: skip
