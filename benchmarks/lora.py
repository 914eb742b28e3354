"""LoRA (rank 16, every projection) against full fine-tuning of the same model: memory from
`mesh3d plan` and from a real run, and step time.

    python benchmarks/lora.py            # ~3 min on 2 cores
    python benchmarks/lora.py --quick

The model is the default config's widened (hidden 512, 8 layers, ~30M parameters) on its
built-in corpus, 16 sequences of 128 tokens a step, one process. Each run (full fine-tuning,
then LoRA, each in a fresh process) trains `--steps` steps and reports:
- the plan's bytes per rank (params, grads, optimizer state, peak);
- what the real run holds: gradient bytes at the optimizer step and optimizer-state bytes after
  the last step, summed over its tensors, and how much the process's peak resident memory grew
  during the run (`ru_maxrss` less the resident memory at its start; it includes the data,
  the activations and what the allocator keeps);
- the median step time over steps 3 on (rank 0's `elapsed_time_per_iteration_ms`).
Results: benchmarks/results/local/lora[_quick].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
from pathlib import Path

import torch
from _ranks import launch
from _results import add_publish_flag, print_header, results_dir

from mesh3d.config import load_config
from mesh3d.data.corpus import default_run_overrides

DEFAULT = Path(__file__).resolve().parents[1] / "mesh3d" / "configs" / "default.yaml"
WIDE = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1408",
        "model.model_config.num_hidden_layers=8", "model.model_config.num_attention_heads=8",
        "model.model_config.num_key_value_heads=8"]  # fmt: skip
LORA = "mesh3d.lora={r: 16, lora_alpha: 32, target_modules: all-linear}"


def _config(steps: int, extra=()):
    return load_config(DEFAULT, [
        *default_run_overrides(), *WIDE, f"tokens.train_steps={steps}", "checkpoints=null",
        "logging.log_level=warning", "tokens.val_check_interval=-1", "tokens.limit_val_batches=0",
        "general.run=lora-bench", *extra,
    ])  # fmt: skip


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _rank(rank: int, world: int, steps: int, extra: list[str]) -> dict:
    from mesh3d.plan import make_plan
    from mesh3d.train.hooks import KeepModel
    from mesh3d.train.loop import train

    before = _rss_bytes()  # a forked rank starts with its parent's pages
    cfg = _config(steps, extra)
    plan = make_plan(cfg).ranks[0]
    grads: list[int] = []  # gradient bytes at each optimizer step (they are freed after it)
    step = torch.optim.AdamW.step

    def counted(self, *a, **k):
        grads.append(_nbytes(p.grad for g in self.param_groups for p in g["params"]
                             if p.grad is not None))  # fmt: skip
        return step(self, *a, **k)

    torch.optim.AdamW.step = counted
    res = train(cfg, hooks=[KeepModel()])
    params = list(res.model.parameters())
    state = [t for s in res.optimizer.state.values() for t in s.values()]
    return {
        "plan": {"param_bytes": plan.param_bytes, "grad_bytes": plan.grad_bytes,
                 "optimizer_bytes": plan.optimizer_bytes, "peak_bytes": plan.peak_bytes},
        "real": {"trainable": sum(p.numel() for p in params if p.requires_grad),
                 "total": sum(p.numel() for p in params),
                 "grad_bytes": max(grads),
                 "optimizer_bytes": _nbytes(state),
                 "rss_growth_bytes": _peak_rss_bytes() - before},
        "step_ms": statistics.median(m["elapsed_time_per_iteration_ms"] for m in res.metrics[2:]),
        "loss": [m["lm_loss"] for m in res.metrics],
    }  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=12)
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    steps = 5 if args.quick else args.steps
    head = print_header()
    runs = {name: launch(1, _rank, steps, extra, timeout=1800)[0]
            for name, extra in (("full", []), ("lora r16", [LORA]))}  # fmt: skip
    full, lora = runs["full"], runs["lora r16"]
    print(f"trainable parameters: full {full['real']['trainable']:,}, LoRA "
          f"{lora['real']['trainable']:,} ({lora['real']['trainable'] / full['real']['trainable']:.2%})")  # fmt: skip
    print(f"{'':24s}{'full':>14s}{'LoRA r16':>14s}{'LoRA / full':>13s}")
    rows = [("plan: params", "plan", "param_bytes"), ("plan: grads", "plan", "grad_bytes"),
            ("plan: optimizer state", "plan", "optimizer_bytes"), ("plan: peak", "plan", "peak_bytes"),
            ("run: grads", "real", "grad_bytes"), ("run: optimizer state", "real", "optimizer_bytes"),
            ("run: peak RSS growth", "real", "rss_growth_bytes")]  # fmt: skip
    for label, part, key in rows:
        a, b = full[part][key], lora[part][key]
        print(f"  {label:22s}{_mib(a):>14s}{_mib(b):>14s}{b / a:12.3f}x")
    print(f"  {'step time (median)':22s}{full['step_ms']:11.1f} ms{lora['step_ms']:11.1f} ms"
          f"{lora['step_ms'] / full['step_ms']:12.3f}x")  # fmt: skip
    result = {**head, "steps": steps, "runs": runs}  # fmt: skip
    out = results_dir(args.publish) / f"lora{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
