"""How fast `mesh3d generate` makes tokens: with its KV cache, without it (the whole sequence
every token), and transformers' `generate` on the same converted checkpoint.

    python benchmarks/generate.py                  # 256 new tokens after a 32-token prompt
    python benchmarks/generate.py --new 64 --rounds 2

One process, fp32, greedy, batch 1, no EOS (every run makes all `--new` tokens). A random Llama
(h 512, ffn 1376, 4 layers, 8/4 heads, vocab 2000) is saved by transformers, converted with
`mesh3d.checkpoint.hf.from_hf` and loaded as `mesh3d generate` loads it. Each round times the
three ways in an order that alternates; reported: the median tokens/s of each and the ratios
cache / transformers and cache / no cache. The tokens of the three must be equal (checked).
Results go to `benchmarks/results/local/generate.json` (`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_publish_flag, results_dir  # noqa: E402

from mesh3d.checkpoint import hf as convert  # noqa: E402
from mesh3d.generation.load import load_model  # noqa: E402
from mesh3d.generation.sampling import generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=int, default=256, help="new tokens (default 256)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_publish_flag(ap)
    args = ap.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    print(f"$ python {' '.join(sys.argv)}\ntorch {torch.__version__}, transformers "
          f"{transformers.__version__}, {torch.get_num_threads()} thread(s), "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # fmt: skip
    cfg = transformers.LlamaConfig(vocab_size=2000, hidden_size=512, intermediate_size=1376,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   num_hidden_layers=4, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(f"{tmp}/hf")
        convert.from_hf(f"{tmp}/hf", f"{tmp}/nt")
        ours, _ = load_model(Path(f"{tmp}/nt"), torch.device("cpu"))
    ids = torch.randint(3, 2000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ways = {
        "mesh3d cache": lambda: generate(ours, ids, args.new, cache=True),
        "mesh3d no cache": lambda: generate(ours, ids, args.new, cache=False),
        "transformers": lambda: hf.generate(ids, max_new_tokens=args.new, do_sample=False,
                                            min_new_tokens=args.new, pad_token_id=0),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ways}
    outputs = {}
    with torch.no_grad():
        for k, f in ways.items():  # warm-up, and the tokens to compare
            outputs[k] = f().tolist()
        for r in range(args.rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for k in order:
                start = time.perf_counter()
                ways[k]()
                times[k].append(time.perf_counter() - start)
    same = outputs["mesh3d cache"] == outputs["mesh3d no cache"] == outputs["transformers"]
    rate = {k: args.new / statistics.median(v) for k, v in times.items()}
    result = {
        "new_tokens": args.new, "prompt_tokens": args.prompt, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "tokens_per_s": rate,
        "cache_vs_transformers": rate["mesh3d cache"] / rate["transformers"],
        "cache_vs_no_cache": rate["mesh3d cache"] / rate["mesh3d no cache"],
        "same_tokens": same, "torch": torch.__version__,
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}",
    }  # fmt: skip
    for k, v in rate.items():
        print(f"{k:>16}: {v:8.1f} tokens/s")
    print(f"cache / transformers {result['cache_vs_transformers']:.2f}x, cache / no cache "
          f"{result['cache_vs_no_cache']:.2f}x; same tokens: {same}")  # fmt: skip
    out = results_dir(args.publish) / "generate.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not same:
        sys.exit("the three ways made different tokens")


if __name__ == "__main__":
    main()
