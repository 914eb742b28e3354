"""Action tables from torch's schedule classes, and a replay of them with per-action costs.

Each rank's compute actions in torch's own order (`pipeline_order` of the schedule class, built
from stand-in stages; GPipe / 1F1B as their step loops run) are replayed with per-action costs:
F(s, k) starts after F(s-1, k); B or I(s, k) after F(s, k) and the input gradient of (s+1, k);
W(s, k) after I(s, k); each rank runs its list in order. With unit costs (F = I = W = 1, B = 2)
the simulated bubbles equal `mesh3d.plan.bubble`'s closed forms.

Bubble = idle / (ranks x step), the step spanning the first action's start to the last one's end.
Lowest of the schedules benchmark's modules: it imports none of the others.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mesh3d.parallel.pipeline import SCHEDULES, is_multi_stage, stage_ids_of_rank
from mesh3d.plan import _orders

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # unit costs: F = I = W, B = I + W
KIND_NAMES = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}

Action = tuple[str, int, int]  # (kind F | B | I | W, stage, microbatch)
Event = tuple[str, int, int, float, float]  # an action with its start and end


def virtual_stages(schedule: str) -> int:
    """Stages per rank used here: 2 for every multi-stage schedule (V schedules need exactly 2)."""
    return 2 if is_multi_stage(schedule) else 1


def action_table(schedule: str, pp: int, v: int, m: int) -> dict[int, list[Action]]:
    """Per pp rank, its compute actions (kind, stage, microbatch) in the order it runs them.

    GPipe and 1F1B as torch's step loops run them (1F1B: min(m, pp - r) warm-up forwards, then
    B/F pairs). Multi-stage schedules: torch's own `pipeline_order`, which the constructor derives
    from the stages' indices only, so stand-in stages do (no process group); OVERLAP_F_B
    (DualPipeV) runs its F, then its B. `mesh3d.plan._orders` reads the same orders but keeps no
    microbatch index, which the simulator needs (LoopedBFS runs its backwards in reverse
    microbatch order); the (kind, stage) sequence is checked against it here.
    """
    table: dict[int, list[Action]] = {}
    if not is_multi_stage(schedule):
        for r in range(pp):
            warm = m if schedule == "afab" else min(m, pp - r)
            fwd = [("F", r, k) for k in range(m)]
            bwd = [("B", r, k) for k in range(m)]
            order = fwd[:warm]
            for k in range(m - warm):
                order += [bwd[k], fwd[warm + k]]
            table[r] = order + bwd[m - warm :]
    else:
        n = pp * v
        stand_ins = [
            types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=n, stage_index=i,
                                  is_first=i == 0, is_last=i == n - 1, submod=nn.Module())
            for i in stage_ids_of_rank(0, pp, v, schedule)
        ]  # fmt: skip
        order = SCHEDULES[schedule](stand_ins, m).pipeline_order
        for r, actions in order.items():
            subs = (a for act in actions if act is not None for a in act.sub_actions or [act])
            table[r] = [
                (KIND_NAMES[a.computation_type.name], a.stage_index, a.microbatch_index)
                for a in subs
                if a.computation_type.name in KIND_NAMES
            ]
    plan_orders = _orders(types.SimpleNamespace(pp=pp, v=v, m=m, schedule=schedule))[0]
    for r, actions in table.items():
        assert [(k, s) for k, s, _ in actions] == plan_orders[r], (schedule, pp, m, r)
    return table


@dataclass
class Timeline:
    """Where every action of one step ran: per rank, events (kind, stage, mb, start, end)."""

    events: dict[int, list[Event]]

    @property
    def start(self) -> float:
        return min(e[3] for evs in self.events.values() for e in evs)

    @property
    def step(self) -> float:
        """First start to last end."""
        return max(e[4] for evs in self.events.values() for e in evs) - self.start

    def busy(self, rank: int) -> float:
        return sum(e[4] - e[3] for e in self.events[rank])

    @property
    def bubble(self) -> float:
        """Idle time / (ranks x step)."""
        busy = sum(self.busy(r) for r in self.events)
        return 1.0 - busy / (len(self.events) * self.step)

    def shifted(self, scale: float = 1.0) -> dict[str, list[list]]:
        """Events relative to the step's start, times x `scale`, as JSON-ready lists."""
        t0 = self.start
        return {
            str(r): [[k, s, mb, round((a - t0) * scale, 3), round((b - t0) * scale, 3)]
                     for k, s, mb, a, b in evs]
            for r, evs in sorted(self.events.items())
        }  # fmt: skip


def simulate(
    table: dict[int, list[Action]],
    cost: Callable[[str, int], float] | None,
    comm: float = 0.0,
    durations: dict[Action, float] | None = None,
) -> Timeline:
    """Replay `table` with `cost(kind, stage)` per action (or each action's own entry in
    `durations`); `comm` is added to cross-rank edges.

    Dependencies: F(s, k) after F(s-1, k); B or I(s, k) after F(s, k) and after the B or I of
    (s+1, k) (the gradient of its output); W(s, k) after I(s, k). Each rank runs its actions in
    table order, each as soon as the rank is free and its inputs are there. Raises if the table
    cannot finish (an order that would deadlock).
    """
    rank_of = {s: r for r, actions in table.items() for _, s, _ in actions}
    last = max(rank_of)
    fwd_end: dict[tuple[int, int], float] = {}
    grad_end: dict[tuple[int, int], float] = {}  # input gradient of (stage, mb) computed
    input_end: dict[tuple[int, int], float] = {}  # I done (W may run)
    pos = {r: 0 for r in table}
    free = {r: 0.0 for r in table}
    events: dict[int, list[Event]] = {r: [] for r in table}
    left = sum(len(a) for a in table.values())
    while left:
        progressed = False
        for r, actions in table.items():
            while pos[r] < len(actions):
                kind, s, k = actions[pos[r]]
                if kind == "F":
                    deps = [] if s == 0 else [(fwd_end.get((s - 1, k)), s - 1)]
                elif kind in "BI":
                    deps = [(fwd_end.get((s, k)), s)]
                    deps += [] if s == last else [(grad_end.get((s + 1, k)), s + 1)]
                else:
                    deps = [(input_end.get((s, k)), s)]
                if any(t is None for t, _ in deps):
                    break
                ready = [t + (comm if rank_of[d] != r else 0.0) for t, d in deps]
                start = max([free[r], *ready])
                end = start + (durations[kind, s, k] if durations else cost(kind, s))
                events[r].append((kind, s, k, start, end))
                free[r] = end
                if kind == "F":
                    fwd_end[s, k] = end
                else:
                    grad_end[s, k] = end if kind in "BI" else grad_end.get((s, k), end)
                    if kind == "I":
                        input_end[s, k] = end
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: table[r][pos[r]] for r in table if pos[r] < len(table[r])}
            raise RuntimeError(f"the action table cannot finish; next actions {stuck}")
    return Timeline(events)
