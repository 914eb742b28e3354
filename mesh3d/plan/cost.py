"""The step-time model of `mesh3d plan --search` (docs/plan-search.md states it in full).

One step of one layout, from its plan's representative ranks (tp, dp, cp index 0: the largest
shards) of every pp rank:
- compute: the rank's tokens through its decoder layers (and the lm_head on the last stage),
  priced by kernel class (`kernels.py`: matmuls, causal attention, memory-bound kernels), a
  rerun forward per recomputed layer; plus `layer_overhead_us` per decoder layer and
  microbatch;
- tp, cp, ep, pp: every byte the plan says the rank sends on that axis, over the link that axis
  crosses (intra-node when its group fits in `nodes_of` consecutive ranks: the mesh is
  (pp, dp, cp, tp), tp innermost; across nodes k members per node share k network cards),
  plus the latency per collective; none of it overlaps compute
  (mesh3d runs TP, CP and EP collectives inline, and a stage waits for its input);
- bubble: the busiest pp rank's time / (1 - the schedule's bubble fraction); with more ranks
  than cores (`cpu_share` < 1) a waiting rank's core runs the others: the pp ranks' mean time
  sets the pace, and the bubble costs only what the busiest rank at a whole core's speed
  / (1 - fraction) exceeds it;
- dp: zero 0 all-reduces the gradients in buckets launched during the last microbatch's
  backward (`parallel/buckets.py`; the plan's rows marked `overlaps`): what exceeds that
  backward (2/3 of a microbatch's compute) is exposed, and so is each module's last bucket
  (its first parameters, final when its backward ends); with more ranks than cores
  the collective's work competes for the same cores: exposed; FSDP
  (zero 1, full shard) without a pipeline overlaps its gathers and reduce-scatters with compute
  except one layer's share; under a pipeline its reduction waits for the last backward, and with
  more ranks than cores no core is free to run it alongside: exposed;
- the dp collectives' memory traffic (the ring's reads and writes, the copies into and out of
  the flat buffers) is added to compute at the memory bandwidth: overlapped or not, it runs on
  the same memory as the kernels;
- optimizer: AdamW reads parameter, gradient and both moments and writes three of them, at the
  memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.plan.hardware import Hardware
from mesh3d.plan.kernels import Work, compute_seconds
from mesh3d.plan.records import RankPlan

AXIS_ORDER = ("pp", "dp", "cp", "tp")  # the mesh's axes, outermost first


@dataclass
class StepTime:
    step_s: float
    parts: dict[str, float]  # seconds on the critical path by cause
    dominant: str  # compute | tp comm | cp comm | ep comm | pp comm | bubble | dp comm | optimizer


def link(axis: str, dims: dict[str, int], ep: int, nodes_of: int, hw: Hardware):
    """(bytes/s, latency s) of the link an axis's groups cross: NVLink's ring bandwidth within a
    node; across nodes, the cards of the group's members on one node, at most NVLink's."""
    stride = 1
    for a in reversed(AXIS_ORDER):
        if a == axis:
            break
        stride *= dims[a]
    size = dims.get(axis, 1) * (dims["cp"] if axis == "dp" else 1)  # dp: over dp x cp
    if axis == "dp":
        stride //= dims["cp"]
    if axis == "ep":  # ep groups take consecutive dp ranks
        stride, size = dims["tp"] * dims["cp"], ep
    if stride * size <= nodes_of:
        return hw.intra_node_gbps * 1e9, hw.latency_us * 1e-6
    # across nodes NCCL runs one ring per network card, so k members per node use k cards
    per_node = max(1, min(size, nodes_of // stride))
    bw = min(hw.intra_node_gbps, per_node * hw.inter_node_gbps)
    return bw * 1e9, hw.latency_us * 1e-6


def step_time(
    ranks: list[RankPlan], shares: list[tuple[int, int, bool]], work: Work, tokens: float,
    dtype: str, dims: dict[str, int], ep: int, m: int, z_mode: tuple[str, bool, str, bool],
    bubble: float, e_p: int, nodes_of: int, hw: Hardware,
) -> StepTime:  # fmt: skip
    """`ranks`: one per pp rank; `shares`: per pp rank (its decoder layers, how many of them
    recompute, whether it holds the lm_head); `work`: per token (`kernels.work_of`); `tokens`:
    the step's tokens of one dp x cp replica; `z_mode`: (dp mode, sequence parallel, recompute
    mode, float8 linears)."""
    mode, sp, recompute, float8 = z_mode
    busy, worst, totals = 0.0, {}, []
    for rank, (layers, recomputed, head) in zip(ranks, shares):
        parts = {"compute": compute_seconds(work, hw, dtype, tokens, layers, recomputed, head,
                                            dims["tp"], sp, recompute, float8)}  # fmt: skip
        parts["compute"] += (layers + recomputed / 3) * m * hw.layer_overhead_us * 1e-6
        for axis in ("tp", "cp", "ep", "pp"):
            items = [c for c in rank.comm if c.axis == axis]
            bw, lat = link(axis, dims, ep, nodes_of, hw)
            t = sum(c.sent_bytes for c in items) / bw + sum(c.count for c in items) * lat
            parts[f"{axis} comm"] = t
        total = sum(parts.values())
        totals.append(total)
        if total >= busy:
            busy, worst, dp_rank, layers_worst = total, parts, rank, layers
    parts = dict(worst)
    idle = busy / (1 - bubble) - busy if bubble < 1 else float("inf")
    if hw.cpu_share < 1:  # more ranks than cores: a rank that waits (bubble, a lighter stage)
        # lends its core, so the machine's total work sets the pace, unless the busiest rank at
        # a whole core's speed is slower still
        mean = sum(totals) / len(totals)
        parts = {k: v * mean / busy for k, v in parts.items()}
        idle = max(0.0, busy * hw.cpu_share / (1 - bubble) - mean)
    parts["bubble"] = idle
    bw, lat = link("dp", dims, ep, nodes_of, hw)

    def seconds(items) -> float:
        return sum(c.sent_bytes for c in items) / bw + sum(c.count for c in items) * lat

    dp_items = [c for c in dp_rank.comm if c.axis == "dp"]
    dp_s = seconds(dp_items)
    # what the dp collectives move through this rank's memory, while compute runs: the ring
    # reads what it sends and writes what it receives (a reduction also reads its addend), and
    # the tensors are copied in and out of the flat buffers (FSDP2's copy-in / copy-out, zero
    # 0's buckets): read and write each full tensor once
    hbm = sum(c.sent_bytes * (2 if c.collective == "all_gather" else 3)
              + 2 * c.count * c.bytes_each for c in dp_items)  # fmt: skip
    parts["compute"] += hbm / hw.memory_bytes_per_s()
    if mode != "replicate" and dims["pp"] == 1 and hw.cpu_share >= 1:
        # FSDP overlaps all but about one layer's share (not where the ranks already share cores)
        dp_s = max(dp_s - parts["compute"], dp_s / max(1, layers_worst))
    elif mode == "replicate" and hw.cpu_share >= 1:
        # zero 0's buckets launched in the last microbatch's backward hide behind it; the last
        # bucket of each module (and all of them under zero-bubble schedules) is exposed
        inside = seconds([c for c in dp_items if c.overlaps])
        dp_s = max(0.0, inside - parts["compute"] * 2 / 3 / m) + dp_s - inside
    parts["dp comm"] = dp_s
    # the optimizer's passes at the device's bandwidth; on a CPU it is not divided among the
    # ranks that share it (a simplification: the step is small beside the rest there)
    hbm_s = hw.memory_gbps * 1e9 * hw.memory_efficiency
    parts["optimizer"] = 7 * dp_rank.param_elements * e_p / hbm_s
    step = sum(parts.values())
    return StepTime(step, parts, max(parts, key=parts.get))
