"""Mamba-1 training tokens/s: mesh3d's model at 1×1×1 against transformers' `MambaForCausalLM`
(its slow path: no mamba-ssm kernels) on the same shapes and the same weights.

    python benchmarks/mamba.py                  # d_model 256, 4 layers, 2 x 256 tokens
    python benchmarks/mamba.py --seq 512 --rounds 10
    python benchmarks/mamba.py --quick          # tiny, a smoke run

One process, one thread, fp32. A step is forward, cross-entropy, backward and an AdamW update;
each round times one step of each model, in an order that alternates every round. Reported: the
median step of each, tokens/s, and the median of the per-round ratios (HF step / mesh3d step =
mesh3d tokens/s over HF's) with a bootstrap 95% interval. Both scans are plain torch with a
Python loop over the sequence; mesh3d's keeps the states and contracts them with C once, HF's
does a matmul per position. Results go to `benchmarks/results/local/mamba[_quick].json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, print_header, results_dir  # noqa: E402
from throughput import bootstrap_median  # noqa: E402

from mesh3d.models.registry import spec_named  # noqa: E402


def models(d_model: int, layers: int, vocab: int):
    """(HF's model, ours) with the same weights, through the family's HF conversion."""
    import transformers

    cfg = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                                   state_size=16, conv_kernel=4, expand=2, use_mambapy=False)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(cfg).float().train()
    hf_spec = spec_named("mamba").hf[0]
    mc = hf_spec.config_from_hf(cfg.to_dict(), "benchmark")
    ours = spec_named("mamba").build(mc).train()
    state = hf_spec.weights_from_hf(dict(hf.state_dict()), mc)
    ours.load_state_dict({hf_spec.hf_to_ours(k): v for k, v in state.items()})
    return hf, ours


def step(model, opt, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    out = model(ids[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="d_model 64, 2 layers, seq 64, 3 rounds")
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.seq, args.rounds = 64, 2, 64, 3
    head = print_header()
    torch.set_num_threads(1)
    hf, ours = models(args.d_model, args.layers, args.vocab)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
            for name, m in (("transformers", hf), ("mesh3d", ours))}  # fmt: skip
    ways = (("transformers", hf), ("mesh3d", ours))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    for name, m in ways:  # warm-up
        step(m, opts[name], ids)
    times: dict[str, list[float]] = {"transformers": [], "mesh3d": []}
    for k in range(args.rounds):
        for name, m in ways if k % 2 == 0 else ways[::-1]:
            times[name].append(step(m, opts[name], ids))
    ratios = [h / o for h, o in zip(times["transformers"], times["mesh3d"])]
    low, high = bootstrap_median(ratios)
    tokens = args.batch * args.seq
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        **head, "d_model": args.d_model, "layers": args.layers, "seq": args.seq,
        "batch": args.batch, "vocab": args.vocab, "rounds": args.rounds,
        "transformers_median_s": med["transformers"], "mesh3d_median_s": med["mesh3d"],
        "transformers_tokens_per_s": tokens / med["transformers"],
        "mesh3d_tokens_per_s": tokens / med["mesh3d"],
        "ratio_median": statistics.median(ratios), "ratio_ci95": [low, high],
    }  # fmt: skip
    print(f"Mamba d_model {args.d_model} x {args.layers} layers (d_state 16, expand 2), batch "
          f"{args.batch} x seq {args.seq}, fp32, 1 thread, {args.rounds} rounds")  # fmt: skip
    for name in ("transformers", "mesh3d"):
        print(
            f"{name:13s} step median {med[name] * 1e3:7.0f} ms  {tokens / med[name]:8.0f} tokens/s"
        )
    print(f"mesh3d / transformers tokens/s: {result['ratio_median']:.3f} "
          f"[95% CI {low:.3f}, {high:.3f}]")  # fmt: skip
    out = results_dir(args.publish) / f"mamba{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
