"""What the CPU pair swap of tensor parallelism saves a training step: tp=2 blocks whose
activations go through gloo's all-reduce / all-gather / reduce-scatter (the "collective" way)
against the swap `mesh3d/tp_styles.py` uses between two CPU ranks (one send and one receive
each way, then the sum, the concatenation or this rank's half).

    python benchmarks/tp_collectives.py           # ~9 minutes on 2 cores
    python benchmarks/tp_collectives.py --tiny    # toy shapes, 2 of the layouts, ~45 s (the test)

Shape: the peer shape of `throughput.py --peer` (Llama hidden 256, ffn 1024, 4 layers, GQA 4/2,
vocab 512, sequence 128, fp32, 4,096 tokens per step). Layouts: tp=2 alone (2 ranks) and
dp=tp=pp=2 (8 ranks), each with `tp_mode` ALL_REDUCE and REDUCE_SCATTER; one intra-op thread per
rank. Each run is `recipes/train.py` under torchrun; the collective way is the same run through
`_collective_train.py`, which turns the swap off. Ways alternate, in reversed order every other
repetition. Reported per layout: the median tokens/s of steps 3..N (what the metrics file logs)
of each way per repetition, their medians and swap / collective. Both ways compute the same
floats (x0 + x1 equals x1 + x0), so every step's logged loss must be identical: the script exits
1 when one differs. Results go to `benchmarks/results/local/tp_collectives[_tiny].json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer import layout_overrides, overrides  # noqa: E402
from _results import add_publish_flag, print_header, results_dir  # noqa: E402
from _ways import torchrun_train  # noqa: E402

HERE = Path(__file__).resolve().parent
WAYS = {"collective": HERE / "_collective_train.py", "swap": HERE.parent / "recipes/train.py"}
LAYOUTS = {  # name -> (dp, tp, pp), tp_mode
    "tp2 ALL_REDUCE": ((1, 2, 1), "ALL_REDUCE"),
    "tp2 REDUCE_SCATTER": ((1, 2, 1), "REDUCE_SCATTER"),
    "2x2x2 ALL_REDUCE": ((2, 2, 2), "ALL_REDUCE"),
    "2x2x2 REDUCE_SCATTER": ((2, 2, 2), "REDUCE_SCATTER"),
}
TINY = ("tp2 REDUCE_SCATTER", "2x2x2 ALL_REDUCE")  # both sizes and both modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes, few steps (the test)")
    ap.add_argument("--repeats", type=int, help="repetitions (default 2; --tiny 1)")
    ap.add_argument("--steps", type=int, help="steps per run (default 12; --tiny 3)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    head = print_header()
    mode = "peer_tiny" if args.tiny else "peer"
    repeats = args.repeats or (1 if args.tiny else 2)
    steps = args.steps or (3 if args.tiny else 12)
    skip = 1 if args.tiny else 2
    layouts = {n: LAYOUTS[n] for n in TINY} if args.tiny else LAYOUTS
    runs: dict = {name: {way: [] for way in WAYS} for name in layouts}
    same = True
    for k in range(repeats):
        for name, (dims, tp_mode) in layouts.items():
            losses = {}
            for way in list(WAYS) if k % 2 == 0 else list(WAYS)[::-1]:
                ranks = dims[0] * dims[1] * dims[2]
                ov = overrides(mode, steps) + layout_overrides(mode, dims, tp_mode)
                metrics, _ = torchrun_train(ranks, ov, script=WAYS[way])
                tps = statistics.median(m["tokens_per_sec"] for m in metrics[skip:])
                losses[way] = [m["lm_loss"] for m in metrics]
                runs[name][way].append(tps)
                print(f"repetition {k + 1} {name:21s} {way:10s} {tps:7.0f} tokens/s", flush=True)
            if losses["collective"] != losses["swap"]:
                print(f"{name}: losses differ: {losses}", file=sys.stderr)
                same = False
    table = {}
    print("\n| layout | collective tokens/s | swap tokens/s | swap / collective (per repetition) |")
    print("|---|---|---|---|")
    for name, ways in runs.items():
        c, s = statistics.median(ways["collective"]), statistics.median(ways["swap"])
        per = [b / a for a, b in zip(ways["collective"], ways["swap"], strict=True)]
        table[name] = dict(ways, collective_median=c, swap_median=s, ratio=s / c, ratios=per)
        each = ", ".join(f"{r:.3f}" for r in per)
        print(f"| {name} | {c:.0f} | {s:.0f} | **{s / c:.3f}** ({each}) |")
    result = {**head, "mode": mode, "steps": steps, "repeats": repeats, "same_losses": same,
              "layouts": table}  # fmt: skip
    path = results_dir(args.publish) / f"tp_collectives{'_tiny' if args.tiny else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
