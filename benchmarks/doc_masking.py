"""What document masking costs on CPU: a Qwen2 step with attention within documents (a boolean
mask for SDPA) against plain causal attention (SDPA's causal kernel), side by side.

    python benchmarks/doc_masking.py                 # seq 1024, documents of ~200 tokens
    python benchmarks/doc_masking.py --seq 2048 --rounds 10

One process, one thread, fp32. Each round times forward + backward of the same batch both ways,
in an order that alternates every round. Reported: the median time of each and the median of
the per-round ratios (masked / causal) with a bootstrap 95% interval. Results go to
`benchmarks/results/local/doc_masking.json` (`--publish`: `benchmarks/results/`). On CUDA, flash-attn's variable-length kernel is the path
for document masking; this CPU figure is the SDPA fallback's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, results_dir  # noqa: E402
from throughput import bootstrap_median  # noqa: E402

from mesh3d.config.other_families import Qwen2Config  # noqa: E402
from mesh3d.data.documents import document_positions  # noqa: E402
from mesh3d.models.qwen2 import Qwen2  # noqa: E402

EOS = 2


def batch(batch_size: int, seq: int, mean_doc: int, seed: int = 0) -> torch.Tensor:
    """Random token ids with an EOS every ~`mean_doc` tokens (documents of random lengths)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (batch_size, seq), generator=g)
    ends = torch.rand(batch_size, seq, generator=g) < 1.0 / mean_doc
    return torch.where(ends, torch.full_like(ids, EOS), ids)


def step(model, ids, positions) -> float:
    t0 = time.perf_counter()
    logits = model(ids, positions=positions)
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--doc", type=int, default=200, help="mean document length in tokens")
    ap.add_argument("--rounds", type=int, default=12)
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mc = Qwen2Config(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                     num_key_value_heads=4, num_hidden_layers=4, vocab_size=1000,
                     eos_token_id=EOS, attention_bias=True)  # fmt: skip
    model = Qwen2(mc, attention="sdpa")
    ids = batch(args.batch, args.seq, args.doc)
    positions = document_positions(ids, EOS)
    docs = int((positions == 0).sum())
    times: dict[str, list[float]] = {"causal": [], "masked": []}
    ways = (("causal", None), ("masked", positions))
    step(model, ids, None), step(model, ids, positions)  # warm-up
    for k in range(args.rounds):
        for name, pos in ways if k % 2 == 0 else ways[::-1]:
            times[name].append(step(model, ids, pos))
    ratios = [m / c for m, c in zip(times["masked"], times["causal"])]
    low, high = bootstrap_median(ratios)
    result = {
        "date": str(datetime.date.today()),
        "torch": torch.__version__,
        "seq": args.seq, "batch": args.batch, "documents": docs, "rounds": args.rounds,
        "causal_median_s": statistics.median(times["causal"]),
        "masked_median_s": statistics.median(times["masked"]),
        "ratio_median": statistics.median(ratios), "ratio_ci95": [low, high],
    }  # fmt: skip
    print(
        f"Qwen2 h512 x 4 layers, batch {args.batch} x seq {args.seq}, {docs} documents, fp32, 1 thread"
    )
    print(f"causal (SDPA is_causal)  median {result['causal_median_s'] * 1e3:.0f} ms")
    print(f"documents (SDPA mask)    median {result['masked_median_s'] * 1e3:.0f} ms")
    print(f"masked / causal: {result['ratio_median']:.3f} [95% CI {low:.3f}, {high:.3f}]")
    out = results_dir(args.publish) / "doc_masking.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
