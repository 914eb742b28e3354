"""`mesh3d plot METRICS.jsonl ... [--output PNG]`: a run's curves against the step, in one image.

Several `--metrics-file` files (`mesh3d/train/metrics.py`) are overlaid, one colour per run.
matplotlib is optional and used through its Agg canvas: no display, no pyplot state.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from mesh3d.errors import UserError, exit_on_user_error

# (title, y label, [(key, line style, marker, what the legend calls it)])
PANELS = [
    ("loss", "loss", [("lm_loss", "-", "", "train"), ("val_loss", "--", "o", "validation")]),
    ("learning rate", "lr", [("lr", "-", "", "")]),
    ("gradient norm (before clipping)", "grad_norm", [("grad_norm", "-", "", "")]),
    ("throughput", "tokens/s", [("tokens_per_sec", "-", "", "")]),
]
EXTRA_PANELS = [("downstream scores (in-run)", "score", "eval/"),  # when a file has these keys
                ("DoReMi domain weights", "weight", "doremi/weight/")]  # fmt: skip
EXAMPLE = "runs/default/metrics.jsonl"


def read_metrics(path: Path) -> list[dict]:
    """The records of one metrics file, in file order; a UserError names the file (and line)."""
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise UserError(
            f"metrics file {path} {what}; pass a file a run wrote with --metrics-file, "
            f"e.g. mesh3d plot {EXAMPLE}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"metrics file {path} cannot be read as text ({e}); pass a .jsonl file "
            "written by --metrics-file"
        ) from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"metrics file {path} line {number} is not JSON ({e.msg}): {line[:80]!r}; each "
                "line must be one JSON object as --metrics-file writes it: fix or delete that line"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            raise UserError(
                f"metrics file {path} line {number} is not a metrics record (a JSON object with "
                f"an integer 'iteration'): {line[:80]!r}; fix or delete that line"
            )
        records.append(record)
    if not records:
        raise UserError(
            f"metrics file {path} is empty: the run has not logged an iteration yet (one line "
            "every logging.iteration_step_info_interval steps); plot it after the first one"
        )
    return records


def run_labels(paths: list[Path]) -> list[str]:
    """Each file's folder name; the file names when two folders share a name; else the paths."""
    for labels in ([p.resolve().parent.name for p in paths], [p.stem for p in paths]):
        if all(labels) and len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def _matplotlib():
    """matplotlib's Figure and Agg canvas classes, or a UserError saying how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "mesh3d plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or install mesh3d with the dev extra: pip install -e '.[dev]')"
        ) from None
    return Figure, FigureCanvasAgg


def _points(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite number under `key`."""
    kept = [r for r in records if isinstance(r.get(key), int | float)]
    kept = [r for r in kept if not isinstance(r[key], bool) and math.isfinite(r[key])]
    return [r["iteration"] for r in kept], [r[key] for r in kept]


def _panel(ax, title: str, ylabel: str, series: list, runs: list, by_key: bool = False) -> None:
    """One panel: every run's curve of each key in `series`, run i in colour Ci (`by_key`: each key)."""
    for r, (label, records) in enumerate(runs):
        for k, (key, style, marker, kind) in enumerate(series):
            steps, values = _points(records, key)
            if steps:
                name = f"{label} {kind}" if kind else label
                dot = marker or ("o" if len(steps) == 1 else "")  # one point shows as a dot
                colour = r * len(series) + k if by_key else r
                line = dict(marker=dot, markersize=3, color=f"C{colour % 10}", label=name)
                ax.plot(steps, values, style, **line)
    if not ax.lines:  # none in the files, or only NaN / inf (a diverged run)
        keys = " / ".join(key for key, *_ in series)
        given = any(key in r for _, rs in runs for r in rs for key, *_ in series)
        where = dict(ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.text(0.5, 0.5, f"{keys}: no finite value" if given else f"no {keys} in these files",
                **where)  # fmt: skip
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _keys(runs: list[tuple[str, list[dict]]], prefix: str) -> list[str]:
    """The keys starting with `prefix` in these files (scores, DoReMi weights), first seen first."""
    return list(dict.fromkeys(k for _, rs in runs for r in rs for k in r if k.startswith(prefix)))


def draw(runs: list[tuple[str, list[dict]]]):
    """A matplotlib Figure of the panels for `runs` = [(label, records)], on an Agg canvas."""
    Figure, FigureCanvasAgg = _matplotlib()
    present = [(*panel, keys) for panel in EXTRA_PANELS if (keys := _keys(runs, panel[2]))]
    fig = Figure(figsize=(12, 12 if present else 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(3 if present else 2, 2, sharex=True)  # loss, lr / grad norm, tokens/s
    for ax, panel in zip(grid.flat, PANELS):
        _panel(ax, *panel, runs)
    for ax, (title, ylabel, prefix, keys) in zip(grid[-1], present):  # (/ scores, weights)
        _panel(ax, title, ylabel, [(k, "-", "o", k.removeprefix(prefix)) for k in keys], runs, True)
        ax.legend(fontsize="small")
    for column in range(2):  # the steps under each column's last panel
        grid[-1, column].set_visible(not present or column < len(present))
        grid[2 if column < len(present) else 1, column].tick_params(labelbottom=True)
        grid[2 if column < len(present) else 1, column].set_xlabel("step")
    if grid[0, 0].lines:
        grid[0, 0].legend(fontsize="small")
    return fig


def write_plot(metrics_files: list[Path], output: Path) -> Path:
    """Draw `metrics_files` (one run each) into `output` (.png, .svg, .pdf, ...); return it.
    The image is written to a temp file and renamed."""
    paths = [Path(p) for p in metrics_files]
    if not paths:
        raise UserError(f"no metrics file given; pass one or more, e.g. mesh3d plot {EXAMPLE}")
    runs = list(zip(run_labels(paths), [read_metrics(p) for p in paths], strict=True))
    fig = draw(runs)
    output = Path(output)
    kind = output.suffix[1:].lower()
    supported = fig.canvas.get_supported_filetypes()
    if kind not in supported:
        raise UserError(
            f"--output {output}: matplotlib cannot write a {output.suffix or 'suffix-less'!r} "
            f"file; end the name with one of {', '.join('.' + k for k in sorted(supported))}, "
            "e.g. metrics.png"
        )
    tmp = output.with_name(output.name + ".tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, format=kind)
        os.replace(tmp, output)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--output {output} cannot be written ({e}); choose another path") from None
    return output


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mesh3d plot", description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", type=Path,
                    help="metrics files written by --metrics-file; several are overlaid")  # fmt: skip
    ap.add_argument("-o", "--output", type=Path, help="image to write (.png, .svg, .pdf; "
                    "default: metrics.png next to the first metrics file)")  # fmt: skip
    args = ap.parse_args(argv)
    print(write_plot(args.metrics, args.output or args.metrics[0].parent / "metrics.png"))


if __name__ == "__main__":
    main()
