"""Data throughput: the tokenize tool (tokens/s) and the Nanoset reader vs dummy data.

    python benchmarks/data_io.py              # ~20 MB of generated text, seq 2048
    python benchmarks/data_io.py --quick      # ~1 MB, seconds

1. Generates JSON Lines text (`mesh3d.data.synthetic`), trains the local BPE tokenizer, and times
   `python -m mesh3d.data.tokenize` on it (in-process): documents, tokens, tokens/s.
2. Builds a two-folder Nanoset (weights 0.7/0.3) at sequence length 2048 and times reading one
   dp rank's microbatches (`StagedData`-style: `microbatches` over the dataset) for many steps,
   side by side with `DummyTokens` (random) over the same steps, interleaved repetitions; median
   samples/s and tokens/s of each, and their ratio. The page cache is warm (files just written).
Results go to `benchmarks/results/data_io[_quick].json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mesh3d.data.dummy import DummyTokens, microbatches
from mesh3d.data.nanoset import Nanoset
from mesh3d.data.synthetic import make_documents, make_tokenizer
from mesh3d.data.tokenize import tokenize_to_folder

ROOT = Path(__file__).resolve().parents[1]


def _time_reads(ds, steps: int, gbs: int, mbs: int) -> float:
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        microbatches(ds, step, gbs, 0, 1, mbs)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print("command:", "python", *map(shlex.quote, sys.argv))
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="mesh3d-data-io-"))
    n_docs = 5_000 if args.quick else 100_000
    tok = make_tokenizer(work / "tok", vocab_size=800)
    folders = []
    tool = {}
    for name, seed, n in (("a", 1, n_docs), ("b", 2, n_docs // 2)):
        text = work / f"{name}.jsonl"
        with open(text, "w", encoding="utf-8") as f:
            for doc in make_documents(n, seed=seed):
                f.write(json.dumps({"text": doc}) + "\n")
        t0 = time.perf_counter()
        _, docs, tokens = tokenize_to_folder(str(tok), [str(text)], str(work / name))
        seconds = time.perf_counter() - t0
        if name == "a":
            tool = {"megabytes": text.stat().st_size / 1e6, "documents": docs, "tokens": tokens,
                    "seconds": seconds, "tokens_per_s": tokens / seconds}  # fmt: skip
        folders.append(work / name)
    print(
        f"tokenize tool: {tool['megabytes']:.1f} MB, {tool['documents']} documents, "
        f"{tool['tokens']} tokens in {tool['seconds']:.1f} s = {tool['tokens_per_s']:,.0f} tokens/s"
    )

    gbs, mbs = 16, 4
    epoch = sum(
        int(len(p.read_bytes()) // 2 // (args.seq + 1)) for f in folders for p in f.glob("*.ds")
    )
    steps = max(1, min(200, epoch // gbs))
    nanoset = Nanoset(folders, [0.7, 0.3], args.seq, steps * gbs, seed=5, vocab_size=800)
    dummy = DummyTokens(800, args.seq, seed=5, kind="random")
    times = {"nanoset": [], "dummy": []}
    for _ in range(args.reps):  # interleaved, so both see the same machine state
        for name, ds in (("nanoset", nanoset), ("dummy", dummy)):
            times[name].append(_time_reads(ds, steps, gbs, mbs))
    samples = steps * gbs
    result = {"date": str(datetime.date.today()), "torch": torch.__version__,
              "cores": os.cpu_count(), "tokenize_tool": tool, "seq_len": args.seq,
              "steps": steps, "global_batch": gbs}  # fmt: skip
    print(f"reader, seq {args.seq}, {steps} steps x {gbs} samples, median of {args.reps}:")
    for name, ts in times.items():
        s = statistics.median(ts)
        result[name] = {
            "seconds": s,
            "samples_per_s": samples / s,
            "tokens_per_s": samples * args.seq / s,
        }
        print(
            f"  {name:8s} {samples / s:12,.0f} samples/s {samples * args.seq / s:16,.0f} tokens/s"
        )
    result["nanoset_over_dummy"] = (
        result["nanoset"]["samples_per_s"] / result["dummy"]["samples_per_s"]
    )
    print(f"  nanoset / dummy: {result['nanoset_over_dummy']:.2f}")
    out = ROOT / "benchmarks" / "results" / f"data_io{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
