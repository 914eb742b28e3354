"""Pipeline arithmetic, without torch: the table of schedules, which layers each stage holds,
which stages each pp rank runs. `checks/validate.py`, `checkpoint/` and `plan/` use it before
any process exists; `parallel/pipeline.py` maps the same names to torch's schedule classes.

    split_by_cost([4096, 4096], head_cost=4096, num_stages=2)   # [[0, 1], []]
    stage_ids_of_rank(0, pp=2, virtual=2, schedule="zbv_zero_bubble")   # [0, 3]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from mesh3d.errors import ConfigError
from mesh3d.models.spec import decoder_cost


def _sequential(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    return (pp - 1) / (m + pp - 1), "(pp-1)/(m+pp-1)", True


def _interleaved(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    return (pp - 1) / (v * m + pp - 1), "(pp-1)/(v*m+pp-1)", True


def _zb1p(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    # ZB1P idles (pp-1)(F+B-2W); with F = I = W and chunks 1/v long, torch's order gives exactly
    # this for m >= pp (benchmarks/schedules's replay, pp 2 to 8)
    why = "(pp-1)/(3*v*m+pp-1): ZB1P idles (pp-1)(F+B-2W), F = I = W, chunks 1/v long"
    return (pp - 1) / (3 * v * m + pp - 1), why, m >= pp


def _zbv(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    # Not the ideal ZB-V's 0 (Qi et al. 2024): torch's ScheduleZBVZeroBubble order (v = 2),
    # replayed with F = I = W = 1 by benchmarks/schedules, idles each rank pp-1 chunk times
    # once m >= 3pp/2 (validation asks m >= 2pp), and 2(2pp-1-m) with fewer microbatches;
    # every m from 1 to 4pp matched this for pp 2 to 8.
    idle = max(pp - 1, 2 * (2 * pp - 1 - m))
    d = "pp-1" if idle == pp - 1 else "2(2pp-1-m)"
    why = f"({d})/(3*v*m+{d}): torch's ZBV order idles {d} chunk times, F = I = W"
    return idle / (3 * v * m + idle), why, True


def _dualpipev(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    # torch's DualPipeV order (m >= 2pp, v = 2) with its overlapped F&B run one after the other,
    # as on one device without communication to hide, idles pp-1 chunk times too
    why = "(pp-1)/(3*v*m+pp-1): torch's DualPipeV order, F&B not overlapped, F = I = W"
    return (pp - 1) / (3 * v * m + pp - 1), why, True


@dataclass(frozen=True)
class Schedule:
    """What mesh3d needs to know of a pipeline schedule before building it: the one place a
    schedule's name is written (`parallel/pipeline.py` maps `torch_class` to torch's class,
    `mesh3d plan` reads `bubble`, the checks `min_microbatches` and `rounds`)."""

    name: str
    torch_class: str  # its class in torch.distributed.pipelining.schedules
    multi_stage: bool  # runs a list of stages per rank (virtual stages or a V)
    v_shape: bool  # exactly 2 stages per rank, rank r holding r and 2*pp-1-r
    zero_bubble: bool  # splits backward into input- and weight-gradient passes
    min_microbatches: str  # "1", "pp", "pp-1" (Nanotron's 1F1B) or "stages" (pp x virtual)
    rounds: bool  # runs microbatches in rounds of pp: their number a multiple of n // pp
    # (pp, virtual stages, microbatches) -> (idle share with equal stage times and F = I = W,
    # the formula, whether it is exact there)
    bubble: Callable[[int, int, int], tuple[float, str, bool]]


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("afab", "ScheduleGPipe", False, False, False, "1", False, _sequential),
        # Nanotron's 1F1B needs pp-1; with fewer than pp it is the all-forward-all-backward order
        Schedule("1f1b", "Schedule1F1B", False, False, False, "pp-1", False, _sequential),
        Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", True, False, False, "pp", True,
                 _interleaved),
        Schedule("looped_bfs", "ScheduleLoopedBFS", True, False, False, "pp", False, _interleaved),
        Schedule("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", True, False, True,
                 "pp", True, _zb1p),
        Schedule("zbv_zero_bubble", "ScheduleZBVZeroBubble", True, True, True, "stages", False,
                 _zbv),
        Schedule("dualpipev", "ScheduleDualPipeV", True, True, True, "stages", False, _dualpipev),
    )
}  # fmt: skip


def schedule(name: str) -> Schedule:
    """The schedule called `name`, or a ConfigError listing the names."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline schedule {name!r} is unknown; set `mesh3d.pp_schedule` (or "
            f"`parallelism.pp_engine`) to one of {', '.join(SCHEDULES)}"
        )
    return SCHEDULES[name]


def microbatches_needed(name: str, pp: int, virtual: int) -> int:
    """The fewest microbatches per step schedule `name` runs with at this pp / virtual."""
    need = schedule(name).min_microbatches
    return {"1": 1, "pp": pp, "pp-1": max(1, pp - 1), "stages": pp * virtual}[need]


def split_by_cost(layer_costs: list[int], head_cost: int, num_stages: int) -> list[list[int]]:
    """The decoder-layer indices of each stage: Nanotron's cost-based walk
    (docs/nanotron-layout.md#pipeline-stages).

    Blocks in order: embedding (cost 0), decoders 0..L-1 (`layer_costs`), final norm (0),
    lm_head (`head_cost`). With cumulative costs c_j and thresholds t_s = total·(s+1)/stages,
    walk the blocks from stage s = 0: the block goes to stage s, then if c_j > t_s, s += 1 — a
    block that crosses a threshold stays on the current stage. The embedding is always on
    stage 0, the final norm and lm_head on the last. Raises ConfigError if a stage would hold
    nothing (no decoder layer, no embedding, no lm_head).
    """
    num_layers = len(layer_costs)
    assert num_stages >= 1, num_stages
    costs = [0, *layer_costs, 0, head_cost]
    cumulative = list(itertools.accumulate(costs))
    thresholds = [cumulative[-1] * ((s + 1) / num_stages) for s in range(num_stages)]
    stage_of, s = [], 0
    for c in cumulative:  # float thresholds, as Nanotron computes them
        stage_of.append(s)
        if c > thresholds[s]:
            s += 1
    layers: list[list[int]] = [[] for _ in range(num_stages)]
    for i in range(num_layers):
        layers[stage_of[1 + i]].append(i)
    head_stage = stage_of[-1]
    for s, owned in enumerate(layers):
        if not owned and s != 0 and s != head_stage:
            raise ConfigError(
                f"pipeline stage {s} of {num_stages} would hold nothing: Nanotron's cost-based "
                f"split of {num_layers} decoder layers (cost {max(layer_costs, default=0)} each) "
                f"and the lm_head (cost {head_cost}) fills only stages {sorted(set(stage_of))}; "
                "use fewer stages (parallelism.pp x mesh3d.pp_virtual_stages) or more layers "
                "(model.model_config.num_hidden_layers)"
            )
    assert stage_of[-2] == head_stage == num_stages - 1, (stage_of, num_stages)
    return layers


def split_layers(
    num_layers: int,
    num_stages: int,
    hidden_size: int,
    ffn_size: int,
    num_heads: int,
    head_dim: int,
    padded_vocab: int,
) -> list[list[int]]:
    """`split_by_cost` with Nanotron's costs: each decoder `decoder_cost`, the lm_head V·h.

    Tiny config (hidden 16, ffn 64, 4 heads, 2 layers, vocab 256, pp 2): decoder cost
    4·4·4·16 + 3·64·16 = 4096, lm_head 4096, total 12288, thresholds [6144, 12288]:
    decoder 0 (c=4096) stays on stage 0, decoder 1 (c=8192 > 6144) stays on stage 0 and moves
    the walk on, so stage 0 = {embedding, 0, 1} and stage 1 = {norm, lm_head}: `[[0, 1], []]`.

    Example:

        mesh3d.split_layers(28, 4, 2048, 8192, 16, 128, 128256)   # 4 lists of layer indices
    """
    cost = decoder_cost(hidden_size, ffn_size, num_heads, head_dim)
    return split_by_cost([cost] * num_layers, padded_vocab * hidden_size, num_stages)


def stage_ids_of_rank(pp_rank: int, pp: int, virtual: int, name: str) -> list[int]:
    """The stages pp rank `pp_rank` runs, in increasing order.

    Looped placement (every schedule but the V ones): stage s on rank s % pp, so rank r holds
    r, r+pp, ... (virtual stages each). V placement (zbv_zero_bubble, dualpipev; virtual = 2):
    rank r holds r and 2·pp-1-r, so rank 0 holds the first and the last stage.
    """
    sched = schedule(name)
    if sched.v_shape:
        if virtual != 2:
            raise ConfigError(f"`mesh3d.pp_virtual_stages` ({virtual}) must be 2 for {name}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if not sched.multi_stage and virtual != 1:
        raise ConfigError(
            f"`mesh3d.pp_virtual_stages` ({virtual}) must be 1 for the single-stage schedule {name}"
        )
    return [pp_rank + k * pp for k in range(virtual)]


def rank_of_stage(stage_id: int, pp: int, name: str) -> int:
    """The pp rank that runs stage `stage_id` (inverse of `stage_ids_of_rank`)."""
    if schedule(name).v_shape and stage_id >= pp:
        return 2 * pp - 1 - stage_id
    return stage_id % pp
