"""What the pipeline schedule does to a step: each rank's order of forwards and backwards, the
activations that order keeps in flight, and the bubble (idle share) in closed form."""

from __future__ import annotations

import types

from torch import nn

from mesh3d.parallel.pipeline import SCHEDULES, is_multi_stage, stage_ids_of_rank
from mesh3d.parallel.pipeline_layout import SCHEDULES as SCHEDULE_TRAITS
from mesh3d.plan.records import Bubble
from mesh3d.plan.sizes import _Sizes


def _orders(z: _Sizes) -> tuple[dict[int, list[tuple[str, int]]], str]:
    """Per pp rank, its (op, stage) sequence: F forward, B backward, I input backward (frees
    the held output and the loss), W weight backward (frees the rest of what was saved).

    GPipe and 1F1B as torch's step loops run them (1F1B: min(m, pp - r) warm-up forwards, then
    B/F pairs). Multi-stage schedules: torch's own `pipeline_order`, which their constructors
    compute from the stages' sizes only, so stand-in stages do (no process group). If that
    private API fails, every chunk is taken to be in flight at once: an upper bound.
    """
    pp, v, m, name = z.pp, z.v, z.m, z.schedule
    if pp == 1:
        return {0: [("F", 0), ("B", 0)] * m}, "no pipeline: one microbatch at a time"
    if not is_multi_stage(name):
        orders = {}
        for r in range(pp):
            warm = m if name == "afab" else min(m, pp - r)
            orders[r] = [("F", r)] * warm + [("B", r), ("F", r)] * (m - warm) + [("B", r)] * warm
        return orders, f"the {SCHEDULES[name].__name__} step loop"
    ids, n = stage_ids_of_rank(0, pp, v, name), pp * v
    stand_ins = [
        types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=n, stage_index=i,
                              is_first=i == 0, is_last=i == n - 1, submod=nn.Module())
        for i in ids
    ]  # fmt: skip
    try:
        order = SCHEDULES[name](stand_ins, m).pipeline_order
    except Exception as e:  # torch-private: say so and bound
        mine = {r: stage_ids_of_rank(r, pp, v, name) for r in range(pp)}
        ops = {r: [(k, s) for k in "FB" for s in mine[r] for _ in range(m)] for r in range(pp)}
        return ops, f"an upper bound, all chunks in flight ({SCHEDULES[name].__name__}: {e!r})"
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    orders = {r: [] for r in range(pp)}
    for r, actions in order.items():
        for action in filter(None, actions):
            for a in action.sub_actions or [action]:  # OVERLAP_F_B: F then B
                if a.computation_type.name in kinds:
                    orders[r].append((kinds[a.computation_type.name], a.stage_index))
    return orders, f"torch {SCHEDULES[name].__name__}.pipeline_order"


def _peaks(
    ops, saved: dict[int, int], held: dict[int, int], loss: dict[int, int] | None = None
) -> tuple[int, int, int]:
    """(peak saved, peak saved + held, peak chunks in flight) over one rank's op sequence.

    F adds a chunk's saved and held bytes; B frees both; I frees the held output and the
    loss's share of the saved bytes (`loss`: stage -> bytes, the last stage's
    `loss_saved_bytes`); W frees the rest of the saved bytes and ends the chunk.
    """
    loss = loss or {}
    now_s = now_h = now_c = peak_s = peak_a = peak_c = 0  # saved, held, chunks
    for op, s in ops:  # (plain branches: `mesh3d plan --search` runs this ~50,000 times)
        if op == "F":
            now_s, now_h, now_c = now_s + saved[s], now_h + held[s], now_c + 1
        elif op == "B":
            now_s, now_h, now_c = now_s - saved[s], now_h - held[s], now_c - 1
        elif op == "I":
            now_s, now_h = now_s - loss.get(s, 0), now_h - held[s]
        else:  # W
            now_s, now_c = now_s + loss.get(s, 0) - saved[s], now_c - 1
        peak_s, peak_a = max(peak_s, now_s), max(peak_a, now_s + now_h)
        peak_c = max(peak_c, now_c)
    return peak_s, peak_a, peak_c


def bubble(schedule: str, pp: int, v: int, m: int) -> Bubble:
    """Idle share of a step with equal stage times (and F = I = W for the split backward): the
    schedule table's formula (`parallel/pipeline_layout.py`)."""
    if pp == 1:
        return Bubble(0.0, "no pipeline", "exact")
    fraction, why, exact = SCHEDULE_TRAITS[schedule].bubble(pp, v, m)
    return Bubble(fraction, why, "exact" if exact else "approximate")
