"""Activation recompute modes: what each saves for backward and what it costs in step time.

    python benchmarks/recompute.py            # 4 modes x 6 rounds, ~2 min
    python benchmarks/recompute.py --rounds 10 --publish

One process trains the 31M-parameter Llama of `overlap.py` (`cpu_tiny.yaml` with hidden 512, 8
layers; fp32; one microbatch of 4 x 256 tokens) under each activation-recompute mode, in a
rotating order, a step of each per round: none, `mesh3d.recompute: selective` (keeps the
matmul and attention outputs, recomputes norms, RoPE, activations), `full` with
`recompute_every: 2` (every second layer) and `full` (Nanotron's `recompute_layer`). Beside the
median step time: the bytes saved for backward per microbatch that `mesh3d plan` predicts for
the mode (the prediction the tests check against measured saved tensors, exactly, in
tests/ranks/test_plan_ranks.py). Results go to `benchmarks/results/local/recompute.json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _results import add_publish_flag, print_header, results_dir

from mesh3d.config import load_config
from mesh3d.plan import make_plan
from mesh3d.train.run import Run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1376",
         "model.model_config.num_attention_heads=8", "model.model_config.num_key_value_heads=4",
         "model.model_config.num_hidden_layers=8", "model.model_config.vocab_size=8000",
         "model.model_config.max_position_embeddings=256",
         "model.model_config.tie_word_embeddings=false", "model.dtype=float32",
         "tokens.sequence_length=256", "tokens.micro_batch_size=4",
         "tokens.batch_accumulation_per_replica=1", "tokens.train_steps=100000",
         "mesh3d.device=cpu", "logging.log_level=warning", "checkpoints=null"]  # fmt: skip
MODES = {
    "none": [],
    "selective": ["mesh3d.recompute=selective"],
    "every 2nd layer": ["mesh3d.recompute=full", "mesh3d.recompute_every=2"],
    "full": ["parallelism.recompute_layer=true"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="steps of each mode (default 6)")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    head = print_header()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    cfgs = {n: load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", MODEL + o)
            for n, o in MODES.items()}  # fmt: skip
    runs, step = {}, 1
    for name, cfg in cfgs.items():  # one process group, one run per mode
        runs[name] = Run.prepare(cfg)
        runs[name].step(step)  # warm-up
    times = {n: [] for n in MODES}
    names = list(MODES)
    for i in range(args.rounds):
        step += 1
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            runs[name].step(step)
            times[name].append(time.perf_counter() - t0)
    none_t = statistics.median(times["none"])
    none_b = make_plan(cfgs["none"], 1).ranks[0].saved_activation_bytes
    rows = {}
    print(f"{'mode':>16} {'saved MiB (plan)':>17} {'vs none':>8} {'step s':>8} {'vs none':>8}")
    for name, cfg in cfgs.items():
        saved = make_plan(cfg, 1).ranks[0].saved_activation_bytes
        t = statistics.median(times[name])
        rows[name] = {"saved_bytes_planned": saved, "saved_over_none": saved / none_b,
                      "step_s": t, "step_over_none": t / none_t, "all_step_s": times[name]}  # fmt: skip
        print(f"{name:>16} {saved / 2**20:17.1f} {saved / none_b:8.2f} {t:8.3f} {t / none_t:8.2f}")
    result = {**head, "rounds": args.rounds, "modes": rows}
    out = results_dir(args.publish) / "recompute.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
