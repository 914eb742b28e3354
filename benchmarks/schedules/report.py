"""The schedules benchmark's outputs: the markdown tables, the timeline chart and compact JSON.

All three render the result dict `main` builds (what the JSON holds). The PNG has one panel per
schedule: simulated (pp=4, m=8) on the left, measured pp=2 on the right, a row per rank, actions
colored by kind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mesh3d.parallel.pipeline import SCHEDULES

MiB = 2**20


def compact_json(obj) -> str:
    """JSON indented by 1, with every innermost list on one line (timeline events stay short).

    Dropping a newline and its indent is safe anywhere: JSON strings cannot hold raw newlines.
    """
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda mt: re.sub(r"\n\s*", "", mt.group(0)), text) + "\n"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _md(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]


def tables(result: dict) -> str:
    """The markdown report: measured table, simulated table, skipped combinations."""
    out = [
        f"### measured: pp={result['measured_pp']}, real processes ({result['measured_device']})",
        "",
    ]
    head = ["schedule", "m", "v", "step ms", "tokens/s", "bubble measured", "bubble replay",
            "bubble sim", "bubble analytic", "F / B (I, W) ms per stage", "peak saved MiB per rank (plan)"]  # fmt: skip
    rows = []
    for r in result["measured"]:
        stages = sorted({int(k[1:]) for k in r["action_ms"]})
        costs = "; ".join(
            f"{s}: " + " ".join(f"{k}{r['action_ms'][f'{k}{s}']:.0f}" for k in "FBIW" if f"{k}{s}" in r["action_ms"])
            for s in stages
        )  # fmt: skip
        mem = ", ".join(
            f"{a / MiB:.0f} ({b / MiB:.0f})"
            for a, b in zip(r["saved_peak_bytes"], r["saved_plan_bytes"])
        )
        rows.append([r["schedule"], r["m"], r["v"], f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
                     _pct(r["bubble"]), _pct(r["bubble_replay"]), _pct(r["bubble_sim"]),
                     _pct(r["bubble_analytic"]), costs, mem])  # fmt: skip
    out += _md(head, rows)
    for r in result["measured"]:
        if r["schedule"] == "1f1b":
            rel = r["bubble"] / r["bubble_analytic"] - 1
            steps = ", ".join(_pct(b) for b in r["bubble_all"])
            out.append(f"\n1F1B pp={r['pp']} m={r['m']}: measured bubble {_pct(r['bubble'])} vs "
                       f"analytic {_pct(r['bubble_analytic'])} ({rel:+.0%} relative; target within "
                       f"10%); every timed step: {steps}; replayed {_pct(r['bubble_replay'])}, so "
                       f"{_pct(r['bubble'] - r['bubble_replay'])} of the step is communication and "
                       "time between actions")  # fmt: skip
    layer, n_layers = result["probe"]["layer_ms"], result["simulated_layers"]
    out += ["", f"### simulated: {n_layers} layers split evenly over pp x v stages; one layer: "
            + ", ".join(f"{k} {layer[k]:.1f} ms" for k in "FBIW") + f" ({result['probe']['device']})", ""]  # fmt: skip
    head = ["schedule", "pp", "m", "v", "step ms", "tokens/s", "bubble sim", "bubble sim (unit)",
            "bubble analytic", "peak saved MiB (max rank)", "in flight (max)"]  # fmt: skip
    rows = [[r["schedule"], r["pp"], r["m"], r["v"], f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
             _pct(r["bubble"]), _pct(r["bubble_unit"]),
             f"{_pct(r['bubble_analytic'])} ({r['analytic_kind']})",
             f"{max(r['saved_peak_bytes']) / MiB:.0f}", max(r["in_flight"])] for r in result["simulated"]]  # fmt: skip
    out += _md(head, rows)
    exact = [r for r in result["simulated"] if r["analytic_kind"] == "exact"]
    equal = sum(abs(r["bubble_unit"] - r["bubble_analytic"]) < 1e-9 for r in exact)
    names = ", ".join(dict.fromkeys(r["schedule"] for r in exact))
    out.append(f"\nUnit costs (F = I = W = 1, B = 2): simulated == analytic in {equal} of {len(exact)} "
               f"rows with an exact closed form ({names}).")  # fmt: skip
    if result["skipped"]:
        out += ["", "### skipped (mesh3d's config validation says why)", ""]
        out += [
            f"- {s['schedule']} pp={s['pp']} m={s['m']} ({s['mode']}): {s['reason']}"
            for s in result["skipped"]
        ]
    return "\n".join(out) + "\n"


COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def _panel(ax, rec: dict, title: str) -> None:
    """One schedule's timeline: a row per rank (rank 0 on top), a box per action."""
    pp, v_shape = rec["pp"], rec["schedule"] in ("zbv_zero_bubble", "dualpipev")
    width = max(e[4] for evs in rec["timeline_ms"].values() for e in evs)
    for r, events in rec["timeline_ms"].items():
        y = pp - 1 - int(r)
        boxes: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for kind, stage, mb, a, b in events:
            second = stage >= pp if v_shape else stage // pp > 0  # the rank's later stage(s)
            boxes.setdefault((kind, int(second)), []).append((a, b - a))
            if b - a > width / 70:
                ax.text(
                    (a + b) / 2, y, str(mb), ha="center", va="center", fontsize=5, color="white"
                )
        for (kind, second), spans in boxes.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white",
                           linewidth=0.4, alpha=0.55 if second else 1.0)  # fmt: skip
    ax.set_yticks(range(pp), [f"rank {pp - 1 - i}" for i in range(pp)], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlim(0, width)
    sim = f", sim {_pct(rec['bubble_sim'])}" if "bubble_sim" in rec else ""
    ax.set_title(f"{rec['schedule']} (v={rec['v']}): {title}; bubble {_pct(rec['bubble'])}{sim}, "
                 f"analytic {_pct(rec['bubble_analytic'])}", fontsize=9)  # fmt: skip


def chart(result: dict, path: Path) -> bool:
    """The timeline chart: a panel per schedule, simulated (left) and measured (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return False
    (pp_sim, m_sim), m_meas = result["chart"]["simulated"], result["chart"]["measured_m"]
    sims = {r["schedule"]: r for r in result["simulated"] if (r["pp"], r["m"]) == (pp_sim, m_sim)}
    meas = {r["schedule"]: r for r in result["measured"] if r["m"] == m_meas}
    columns = [(sims, f"simulated pp={pp_sim} m={m_sim}"),
               (meas, f"measured pp={result['measured_pp']} m={m_meas}")]  # fmt: skip
    names = [n for n in SCHEDULES if n in sims or n in meas]
    fig, axes = plt.subplots(len(names), 2, figsize=(18, 1.0 + 1.45 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, (recs, title) in enumerate(columns):
            if name in recs:
                _panel(axes[row][col], recs[name], title)
            else:
                axes[row][col].set_axis_off()
                axes[row][col].set_title(f"{name}: {title} not run", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("ms", fontsize=8)
    kinds = ("F forward", "B full backward", "I input grad", "W weight grad")
    legend = [Patch(color=c, label=k) for k, c in zip(kinds, COLORS.values())]
    legend.append(Patch(color="grey", alpha=0.55, label="lighter: the rank's 2nd stage"))
    legend.append(Patch(color="white", label="numbers: microbatch"))
    fig.legend(handles=legend, loc="upper center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
