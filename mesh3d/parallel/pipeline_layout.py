"""Pipeline arithmetic, without torch: the table of schedules, which layers each stage holds,
which stages each pp rank runs (usable before any process exists).

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
    # exact for m >= pp (benchmarks/schedules's replay, pp 2 to 8)
    why = "(pp-1)/(3*v*m+pp-1): ZB1P idles (pp-1)(F+B-2W), F = I = W, chunks 1/v long"
    return (pp - 1) / (3 * v * m + pp - 1), why, m >= pp


def _zbv(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    # not the ideal ZB-V's 0: torch's order, replayed by benchmarks/schedules (m 1 to 4pp, pp 2
    # to 8), idles pp-1 chunk times once m >= 3pp/2, else 2(2pp-1-m)
    idle = max(pp - 1, 2 * (2 * pp - 1 - m))
    d = "pp-1" if idle == pp - 1 else "2(2pp-1-m)"
    why = f"({d})/(3*v*m+{d}): torch's ZBV order idles {d} chunk times, F = I = W"
    return idle / (3 * v * m + idle), why, True


def _dualpipev(pp: int, v: int, m: int) -> tuple[float, str, bool]:
    why = "(pp-1)/(3*v*m+pp-1): torch's DualPipeV order, F&B not overlapped, F = I = W"
    return (pp - 1) / (3 * v * m + pp - 1), why, True


@dataclass(frozen=True)
class Schedule:
    """What mesh3d needs to know of a pipeline schedule before building it."""

    name: str
    torch_class: str  # its class in torch.distributed.pipelining.schedules
    multi_stage: bool  # runs a list of stages per rank (virtual stages or a V)
    v_shape: bool  # exactly 2 stages per rank, rank r holding r and 2*pp-1-r
    zero_bubble: bool  # splits backward into input- and weight-gradient passes
    min_microbatches: str  # "1", "pp", "pp-1" (Nanotron's 1F1B) or "stages" (pp x virtual)
    rounds: bool  # runs microbatches in rounds of pp: their number a multiple of n // pp
    # (pp, virtual, microbatches) -> (idle share at F = I = W, the formula, whether it is exact)
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

    Blocks: embedding (cost 0), decoders, final norm (0), lm_head. Each goes to stage s, then
    s += 1 if its cumulative cost exceeds total·(s+1)/stages."""
    num_layers = len(layer_costs)
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    cumulative = list(itertools.accumulate([0, *layer_costs, 0, head_cost]))
    thresholds = [cumulative[-1] * ((s + 1) / num_stages) for s in range(num_stages)]
    stage_of, s = [], 0
    for c in cumulative:  # float thresholds, as Nanotron computes them
        stage_of.append(s)
        if c > thresholds[s]:
            s += 1
    layers = [[i for i in range(num_layers) if stage_of[1 + i] == s] for s in range(num_stages)]
    head_stage = stage_of[-1]
    for s, owned in enumerate(layers):
        if not owned and s != 0 and s != head_stage:
            raise ConfigError(
                f"pipeline stage {s} of {num_stages} would hold nothing: Nanotron's cost-based "
                f"split of {num_layers} decoder layers (cost {max(layer_costs, default=0)} each) "
                f"and the lm_head (cost {head_cost}) gives layers to stages {[s for s, o in enumerate(layers) if o]} only; "
                "use fewer stages (parallelism.pp x mesh3d.pp_virtual_stages) or more layers "
                "(model.model_config.num_hidden_layers)"
            )
    assert stage_of[-2] == head_stage == num_stages - 1, (stage_of, num_stages)
    return layers


def split_layers(num_layers: int, num_stages: int, hidden_size: int, ffn_size: int,
                 num_heads: int, head_dim: int, padded_vocab: int) -> list[list[int]]:  # fmt: skip
    """`split_by_cost` with Nanotron's costs: each decoder `decoder_cost`, the lm_head V·h.

    Example:

        mesh3d.split_layers(28, 4, 2048, 8192, 16, 128, 128256)   # 4 lists of layer indices
    """
    cost = decoder_cost(hidden_size, ffn_size, num_heads, head_dim)
    return split_by_cost([cost] * num_layers, padded_vocab * hidden_size, num_stages)


def stage_ids_of_rank(pp_rank: int, pp: int, virtual: int, name: str) -> list[int]:
    """The stages pp rank `pp_rank` runs, in increasing order: r, r+pp, ... (looped), or r and
    2·pp-1-r (V schedules, virtual = 2)."""
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
