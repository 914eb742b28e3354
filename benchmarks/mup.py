"""What µP is for: does the best learning rate stay put as the model widens?

    python benchmarks/mup.py                 # widths 64, 128, 256; 9 rates 2^-12 .. 2^-4; ~6 min
    python benchmarks/mup.py --steps 30 --rates 5   # quicker
    python benchmarks/mup.py --publish       # write benchmarks/results/mup.{json,png}
    python benchmarks/mup.py --replot benchmarks/results/mup.json   # redraw the PNG only

For each width (same depth, heads of 32, MLP 4x, the same tokens: the built-in corpus of
`mesh3d train`, 16 sequences of 128 tokens per step) and each learning rate, one run under the
standard parametrization (`init_method: {std: 0.02}`, every parameter at the same rate) and one
under spectral µP (`init_method: {use_mup: true}`, `mesh3d/models/mup.py`). The loss reported is
the mean training loss of the last 10 steps (a run that diverges to a non-finite loss counts as
not trained). It prints the table and each width's best rate, and plots loss against the rate,
one curve per width, SP and µP side by side (PNG beside the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, results_dir  # noqa: E402

from mesh3d.config import load_config  # noqa: E402
from mesh3d.data.corpus import default_run_overrides  # noqa: E402
from mesh3d.errors import RunStopped  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1] / "mesh3d" / "configs" / "default.yaml"
WIDTHS = (64, 128, 256)


def one_run(width: int, lr: float, mup: bool, steps: int, data: list[str]) -> float:
    """Mean training loss of the last 10 steps (inf when the run diverged)."""
    init = "{use_mup: true}" if mup else "{std: 0.02}"
    overrides = [
        *data,
        f"model.init_method={init}",
        f"model.model_config.hidden_size={width}",
        f"model.model_config.intermediate_size={4 * width}",
        f"model.model_config.num_attention_heads={width // 32}",
        f"model.model_config.num_key_value_heads={width // 32}",
        "model.model_config.tie_word_embeddings=false",
        f"optimizer.learning_rate_scheduler.learning_rate={lr}",
        f"optimizer.learning_rate_scheduler.min_decay_lr={lr / 10}",
        f"optimizer.learning_rate_scheduler.lr_warmup_steps={max(1, steps // 10)}",
        f"tokens.train_steps={steps}",
        "checkpoints=null",
        "general.run=mup-bench",
        "logging.log_level=warning",
        "tokens.val_check_interval=-1",
        "tokens.limit_val_batches=0",
    ]
    try:
        metrics = train(load_config(DEFAULT, overrides)).metrics
    except RunStopped:  # the non-finite guard stopped a diverged run
        return math.inf
    last = [m["lm_loss"] for m in metrics[-10:]]
    return statistics_mean(last) if all(math.isfinite(x) for x in last) else math.inf


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def plot(results: dict, rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    finite = [x for k in results.values() for row in k.values() for x in row.values()
              if math.isfinite(x)]  # fmt: skip
    low = min(finite)
    for ax, kind in zip(axes, ("sp", "mup")):
        for width in WIDTHS:
            losses = [results[kind][str(width)][str(r)] for r in rates]
            ax.plot([math.log2(r) for r in rates], [x if math.isfinite(x) else float("nan")
                    for x in losses], marker="o", label=f"width {width}")  # fmt: skip
        ax.set_title("standard parametrization" if kind == "sp" else "spectral µP")
        ax.set_ylim(low - 0.2, low + 2.5)  # the minima; diverged rates run off the top
        ax.set_xlabel("log2(learning rate)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (mean of the last 10 steps)\n(higher values cut off)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    ap.add_argument("--rates", type=int, default=9, help="rates from 2^-12 to 2^-4 (default 9)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG beside this mup.json")
    add_publish_flag(ap)
    args = ap.parse_args()
    if args.replot:
        record = json.loads(args.replot.read_text())
        plot(record["loss"], record["rates"], args.replot.with_suffix(".png"))
        return
    torch.set_num_threads(2)
    rates = [2.0 ** (-12 + 8 * i / (args.rates - 1)) for i in range(args.rates)]
    data = default_run_overrides()
    results: dict = {"sp": {}, "mup": {}}
    start = time.perf_counter()
    for width in WIDTHS:
        for kind in ("sp", "mup"):
            row = results[kind].setdefault(str(width), {})
            for lr in rates:
                row[str(lr)] = one_run(width, lr, kind == "mup", args.steps, data)
                print(f"{kind:4s} width {width:4d} lr 2^{math.log2(lr):6.2f}: "
                      f"loss {row[str(lr)]:.4f}", flush=True)  # fmt: skip
    best = {
        kind: {w: min(rates, key=lambda r: results[kind][str(w)][str(r)]) for w in WIDTHS}
        for kind in results
    }
    print("\nbest learning rate per width (log2):")
    for kind in results:
        print(f"  {kind:4s} " + "  ".join(f"{w}: {math.log2(best[kind][w]):.2f}" for w in WIDTHS))
    drift = {k: math.log2(max(best[k].values())) - math.log2(min(best[k].values())) for k in best}
    print(f"  drift of the best rate across widths (log2 units): sp {drift['sp']:.2f}, "
          f"mup {drift['mup']:.2f}")  # fmt: skip
    out = results_dir(args.publish)
    record = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/mup.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "widths": list(WIDTHS),
        "rates": rates,
        "loss": results,
        "best_log2_lr": {k: {str(w): math.log2(v) for w, v in b.items()} for k, b in best.items()},
        "drift_log2": drift,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / "mup.json").write_text(json.dumps(record, indent=2, default=str))
    plot(results, rates, out / "mup.png")
    print(f"wrote {out / 'mup.json'} and {out / 'mup.png'}")


if __name__ == "__main__":
    main()
