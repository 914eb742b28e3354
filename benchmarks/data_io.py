"""Data throughput: the tokenize tool (tokens/s) and the Nanoset reader vs dummy data.

    python benchmarks/data_io.py              # ~20 MB of generated text, seq 2048
    python benchmarks/data_io.py --quick      # ~1 MB, seconds

1. Generates JSON Lines text (`mesh3d.data.synthetic`), trains the local BPE tokenizer, and times
   `python -m mesh3d.data.tokenize` on it (in-process): documents, tokens, tokens/s.
2. Builds a two-folder Nanoset (weights 0.7/0.3) at sequence length 2048 and times reading one
   dp rank's microbatches (`StagedData`-style: `microbatches` over the dataset) for many steps,
   side by side with `DummyTokens` (random) over the same steps, interleaved repetitions; median
   samples/s and tokens/s of each, and their ratio. The page cache is warm (files just written).
3. The loader against the training step's need on the default CPU config (cpu_tiny.yaml:
   sequence 128, global batch 16): Nanoset samples/s at those shapes over the samples/s that
   `train()` reaches on this machine (median step time of a 12-step run in this process).
4. Peak memory of reading a 1 GB folder (`--rss-gb`, random uint16 tokens): a fresh process
   builds the Nanoset (which scans every token id) and reads every sample once; it reports
   ru_maxrss and its anonymous / file-backed resident memory before and after.
5. The loader (`mesh3d.data.loader`) on the default config's shapes (mesh3d/configs/default.yaml:
   sequence 128, global batch 16), side by side in one run: the samples/s it delivers (after
   its workers' start, which is printed apart) for a Nanoset folder, a map-style HF JSON Lines
   file and the same file streamed (`mesh3d.hf_streaming`, tokenized on the fly) at 0, 1 and 2
   `num_loading_workers`, against the samples/s a training step of that config consumes; then
   the step times (median, mean, max) of interleaved 20-step `train()` runs on the streamed file at 0 and 2 workers and
   on the pre-tokenized Nanoset. `--loader` runs this part alone.
6. Streamed data at several layouts (`--streams` runs this part alone): the tokenizer CPU
   seconds per step summed over a dp replica's ranks at tp 1, 2 and 4 (one rank reads and
   tokenizes for its replica, `train/stream_share.py`; and, for comparison, with every rank
   reading as before), the loader's samples/s at dp 1, 2, 4 with 0 and 2 workers (each rank
   owns whole logical shards), and the step time of 20-step tp 2 runs streamed (2 workers)
   against the Nanoset, interleaved.
Results go to `benchmarks/results/local/data_io[_quick|_loader|_streams].json` (`--publish`:
`benchmarks/results/`).
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
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path when a script runs

from mesh3d.config import global_batch_size, load_config
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


def _rss() -> dict:
    """Resident memory of this process from /proc (MB): anonymous and file-backed."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _rss_child(folder: str, seq: int) -> None:
    """In a fresh process: build a Nanoset over `folder` and read every sample once."""
    import resource

    before = _rss()
    ds = Nanoset([folder], None, seq, num_samples=1, seed=1, vocab_size=50_000)
    n = ds.epoch_len
    ds = Nanoset([folder], None, seq, num_samples=n, seed=1, vocab_size=50_000)
    built = _rss()
    t0 = time.perf_counter()
    checksum = 0
    for i in range(n):
        checksum += int(ds[i][0][0])
    seconds = time.perf_counter() - t0
    after = _rss()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"samples": n, "read_s": seconds, "before_MB": before, "after_build_MB": built,
                      "after_read_MB": after, "ru_maxrss_MB": maxrss}))  # fmt: skip


def _rss_of_reading(gigabytes: float, seq: int, work: Path) -> dict:
    import subprocess

    import numpy as np

    folder = work / "big"
    folder.mkdir()
    rng = np.random.default_rng(0)
    tokens_left = int(gigabytes * 1e9) // 2
    with open(folder / "00000_unshuffled.ds", "wb") as f:
        while tokens_left:
            n = min(tokens_left, 32 * 2**20)
            rng.integers(0, 50_000, n, dtype=np.uint16).tofile(f)
            tokens_left -= n
    cmd = [sys.executable, __file__, "--rss-child", str(folder), "--seq", str(seq)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"gigabytes": gigabytes, **json.loads(out.strip().splitlines()[-1])}


def _training_need(config: Path) -> dict:
    """Loader samples/s at the config's shapes vs the samples/s `train()` reaches."""
    from mesh3d.train.loop import train

    cfg = load_config(config, ["tokens.train_steps=12", "logging.log_level=warning"])
    ms = statistics.median(m["elapsed_time_per_iteration_ms"] for m in train(cfg).metrics[3:])
    gbs, seq, mbs = global_batch_size(cfg), cfg.tokens.sequence_length, cfg.tokens.micro_batch_size
    return {"config": config.name, "seq_len": seq, "global_batch": gbs, "micro_batch": mbs,
            "train_samples_per_s": gbs / (ms / 1000)}  # fmt: skip


def _default_cfg(work: Path, kind: str, workers: int, steps: int, extra=()):
    """The default config on generated data of `kind` (nanoset | hf | stream)."""
    if kind == "nanoset":
        dataset = f"{{dataset_folder: [{work / 'corpus'}]}}"
    else:
        dataset = f"{{hf_dataset_or_datasets: {work / 'corpus.jsonl'}, text_column_name: text}}"
    stage = (f"[{{name: s, start_training_step: 1, data: {{seed: 5, num_loading_workers: "
             f"{workers}, dataset: {dataset}}}}}]")  # fmt: skip
    return load_config(ROOT / "mesh3d" / "configs" / "default.yaml", [
        f"data_stages={stage}", f"tokenizer.tokenizer_name_or_path={work / 'tok4k'}",
        f"tokens.train_steps={steps}", "tokens.limit_val_batches=0", "tokens.val_check_interval=-1",
        "logging.log_level=warning",
        f"mesh3d.hf_streaming={'true' if kind == 'stream' else 'false'}",
        f"checkpoints.checkpoints_path={work / f'ck-{kind}-{workers}'}",
        "checkpoints.save_final_state=false", *extra])  # fmt: skip


def _loader_rates(work: Path, steps: int, reps: int) -> dict:
    """Samples/s the loader delivers per (data kind, workers), and its start time."""
    from mesh3d.data.build import StagedData
    from mesh3d.data.loader import Feed

    out = {}
    for kind in ("nanoset", "hf", "stream"):
        for workers in (0, 1, 2):
            cfg = _default_cfg(work, kind, workers, steps + 1)
            data, mbs = StagedData(cfg), cfg.tokens.micro_batch_size
            starts, rates = [], []
            for _ in range(reps):
                feed = Feed(data, 0, 1, mbs, timeout_s=300)
                t0 = time.perf_counter()
                feed.batches(1)  # the workers start and read ahead
                t1 = time.perf_counter()
                for step in range(2, steps + 2):
                    feed.batches(step)
                t2 = time.perf_counter()
                feed.close()
                starts.append(t1 - t0)
                rates.append(steps * global_batch_size(cfg) / (t2 - t1))
            out[f"{kind}/{workers}"] = {"samples_per_s": statistics.median(rates),
                                        "first_batch_s": statistics.median(starts)}  # fmt: skip
    return out


def _step_ms(work: Path, runs: list[tuple[str, int]], rounds: int) -> dict:
    """Step times of 20-step `train()` runs of each (kind, workers), the runs interleaved
    `rounds` times so that all see the same machine; steps 3-20 of every round pooled."""
    from mesh3d.train.loop import train

    pooled: dict[str, list[float]] = {f"{k}/{w}": [] for k, w in runs}
    for _ in range(rounds):
        for kind, workers in runs:
            metrics = train(_default_cfg(work, kind, workers, 20)).metrics
            pooled[f"{kind}/{workers}"] += [m["elapsed_time_per_iteration_ms"] for m in metrics[2:]]
    return {key: {"median": statistics.median(ms), "mean": statistics.mean(ms), "max": max(ms)}
            for key, ms in pooled.items()}  # fmt: skip


def _corpus(work: Path, n: int) -> None:
    """`work`/tok4k, `work`/corpus.jsonl of `n` generated documents and its Nanoset folder."""
    if (work / "corpus").is_dir():
        return
    tok = make_tokenizer(work / "tok4k", vocab_size=4096)
    text = work / "corpus.jsonl"
    with open(text, "w", encoding="utf-8") as f:
        for doc in make_documents(n, seed=3):
            f.write(json.dumps({"text": doc}) + "\n")
    tokenize_to_folder(str(tok), [str(text)], str(work / "corpus"))


def _loader_part(work: Path, quick: bool, reps: int, rounds: int = 2) -> dict:
    """Part 5 (module doc): the loader per data kind and worker count vs a step's need."""
    n = 4_000 if quick else 20_000
    _corpus(work, n)
    steps = 40 if quick else 150
    rates = _loader_rates(work, steps, reps)
    step = _step_ms(work, [("nanoset", 0), ("stream", 0), ("stream", 2)], 1 if quick else rounds)
    need = 16 / (
        step["nanoset/0"]["median"] / 1000
    )  # samples/s a step of the default config consumes
    print(
        f"loader on the default config's shapes (seq 128, global batch 16; {n} documents, "
        f"{steps} steps, median of {reps}); a training step consumes {need:,.0f} samples/s"
    )
    print(f"  {'data':8s} {'workers':>7s} {'samples/s':>12s} {'x a step':>9s} {'first batch':>12s}")
    for key, r in rates.items():
        kind, w = key.split("/")
        print(f"  {kind:8s} {w:>7s} {r['samples_per_s']:12,.0f} "
              f"{r['samples_per_s'] / need:8,.1f}x {r['first_batch_s']:11.2f}s")  # fmt: skip
    print(
        f"step time of 20-step train() runs on the default config (steps 3-20 of "
        f"{1 if quick else rounds} interleaved rounds; a streamed stage tokenizes a 256-sample "
        "block every 16 steps):"
    )
    base = step["nanoset/0"]["mean"]
    for key, t in step.items():
        kind, w = key.split("/")
        what = "pre-tokenized Nanoset" if kind == "nanoset" else "streamed, tokenized on the fly"
        print(f"  {what:32s} {w} workers: median {t['median']:6.1f}, mean {t['mean']:6.1f} "
              f"({t['mean'] / base:.2f}x), max {t['max']:6.1f} ms/step")  # fmt: skip
    return {"documents": n, "steps": steps, "train_samples_per_s": need, "loader": rates,
            "step_ms": step}  # fmt: skip


def _tokenize_rank(rank: int, world: int, work: str, steps: int, share: bool) -> dict:
    """One rank of a tp = `world` run on the streamed corpus (num_loading_workers 0, so the
    tokenizer runs in this process): the CPU seconds its tokenizer took per step."""
    from mesh3d.data import streaming
    from mesh3d.train import stream_share
    from mesh3d.train.loop import train

    spent, texts_seen = [0.0], [0]
    encode = streaming.StreamedText.encode

    def timed(self, texts):
        t0 = time.thread_time()
        out = encode(self, texts)
        spent[0] += time.thread_time() - t0
        texts_seen[0] += len(texts)
        return out

    streaming.StreamedText.encode = timed
    if not share:  # every rank of the replica reads and tokenizes, as before issue 45
        stream_share.needs_share = lambda data, dims: False  # looked up at build
    cfg = _default_cfg(Path(work), "stream", 0, steps, [f"parallelism.tp={world}"])
    train(cfg)
    return {"tokenizer_cpu_s_per_step": spent[0] / steps, "texts_per_step": texts_seen[0] / steps}


def _step_rank(rank: int, world: int, work: str, kind: str, workers: int, steps: int) -> list:
    from mesh3d.train.loop import train

    cfg = _default_cfg(Path(work), kind, workers, steps, [f"parallelism.tp={world}"])
    return [m["elapsed_time_per_iteration_ms"] for m in train(cfg).metrics[2:]]


def _stream_part(work: Path, quick: bool, reps: int, rounds: int) -> dict:
    """Part 6 (module doc): streamed data at several layouts (issue 45's measurements)."""
    from _ranks import launch

    from mesh3d.data.build import StagedData
    from mesh3d.data.loader import Feed

    _corpus(work, 4_000 if quick else 20_000)
    steps = 8 if quick else 24
    out: dict = {"tokenizer": {}, "loader": {}, "step_ms": {}}
    print(f"streamed data (default config's shapes: seq 128, global batch 16, "
          f"{steps}-step runs):")  # fmt: skip
    print("  tokenizer CPU seconds per step, summed over a dp replica's ranks (tp x, dp 1):")
    for share in (True, False):
        for tp in (1, 2, 4):
            ranks = launch(tp, _tokenize_rank, str(work), steps, share, timeout=900)
            total = sum(r["tokenizer_cpu_s_per_step"] for r in ranks)
            texts = sum(r["texts_per_step"] for r in ranks)
            key = f"{'read once' if share else 'every rank reads'}/tp{tp}"
            out["tokenizer"][key] = total
            out["tokenizer"][key + " texts"] = texts
            base = out["tokenizer"][f"{'read once' if share else 'every rank reads'}/tp1"]
            print(f"    {key:24s} {total * 1000:8.2f} ms  ({total / base:.2f}x tp1), "
                  f"{texts:6.1f} documents tokenized a step")  # fmt: skip
    pooled: dict[str, list[float]] = {"nanoset": [], "stream": []}
    for _ in range(rounds):  # interleaved, so both see the same machine
        for kind, workers in (("nanoset", 0), ("stream", 2)):
            pooled[kind] += launch(2, _step_rank, str(work), kind, workers, 20, timeout=900)[0]
    for kind, ms in pooled.items():
        out["step_ms"][kind] = {"median": statistics.median(ms), "mean": statistics.mean(ms)}
    ratio = out["step_ms"]["stream"]["median"] / out["step_ms"]["nanoset"]["median"]
    out["step_ms"]["stream_over_nanoset"] = ratio
    print(f"  step time at tp 2 (steps 3-20 of {rounds} interleaved rounds): Nanoset median "
          f"{out['step_ms']['nanoset']['median']:.1f} ms, streamed (2 workers) "
          f"{out['step_ms']['stream']['median']:.1f} ms = {ratio:.3f}x")  # fmt: skip
    # in this process last: a rank forked after this process started a forkserver would
    # share it, and its workers would not be the rank's children
    print("  loader samples/s of one dp rank (and of the whole step, x dp):")
    for dp in (1, 2, 4):
        for workers in (0, 2):
            cfg = _default_cfg(work, "stream", workers, 4 * steps + 1)
            data, mbs = StagedData(cfg), cfg.tokens.micro_batch_size
            rates = []
            for _ in range(reps):
                feed = Feed(data, 0, dp, mbs, timeout_s=300)
                feed.batches(1)  # the workers start and read ahead
                t0 = time.perf_counter()
                for step in range(2, 4 * steps + 2):
                    feed.batches(step)
                rates.append(4 * steps * data.gbs / dp / (time.perf_counter() - t0))
                feed.close()
            r = statistics.median(rates)
            out["loader"][f"dp{dp}/w{workers}"] = r
            print(f"    dp {dp} workers {workers}: {r:10,.0f} samples/s per rank, "
                  f"{r * dp:10,.0f} for {dp} rank(s)")  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2,
                    help="part 5: interleaved rounds of the step-time runs")  # fmt: skip
    ap.add_argument("--rss-gb", type=float, default=1.0, help="size of the folder for the RSS test")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    ap.add_argument("--loader", action="store_true", help="run part 5 (the loader) alone")
    ap.add_argument("--streams", action="store_true",
                    help="run part 6 (streamed data at several layouts) alone")  # fmt: skip
    add_publish_flag(ap)
    args = ap.parse_args(argv)
    if args.rss_child:
        _rss_child(args.rss_child, args.seq)
        return 0
    print("command:", "python", *map(shlex.quote, sys.argv))
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="mesh3d-data-io-"))
    if args.streams:
        result = {"date": str(datetime.date.today()), "torch": torch.__version__,
                  "cores": os.cpu_count(),
                  "streams": _stream_part(work, args.quick, args.reps, args.rounds)}  # fmt: skip
        out = results_dir(args.publish) / f"data_io_streams{'_quick' if args.quick else ''}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    if args.loader:
        result = {"date": str(datetime.date.today()), "torch": torch.__version__,
                  "cores": os.cpu_count(), "loader": _loader_part(work, args.quick, args.reps, args.rounds)}  # fmt: skip
        out = results_dir(args.publish) / f"data_io_loader{'_quick' if args.quick else ''}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
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

    need = _training_need(ROOT / "recipes" / "configs" / "cpu_tiny.yaml")
    small = Nanoset(folders, [0.7, 0.3], need["seq_len"], 200 * need["global_batch"], 5, 800)
    loader_s = statistics.median(
        _time_reads(small, 200, need["global_batch"], need["micro_batch"]) for _ in range(args.reps)
    )
    need["loader_samples_per_s"] = 200 * need["global_batch"] / loader_s
    need["loader_over_training"] = need["loader_samples_per_s"] / need["train_samples_per_s"]
    result["training_need"] = need
    print(
        f"loader vs training on {need['config']} (seq {need['seq_len']}, batch "
        f"{need['global_batch']}): {need['loader_samples_per_s']:,.0f} vs "
        f"{need['train_samples_per_s']:,.1f} samples/s = {need['loader_over_training']:,.0f}x "
        "what a step needs"
    )
    gb = 0.05 if args.quick else args.rss_gb
    rss = _rss_of_reading(gb, args.seq, work)
    result["rss"] = rss
    result["loader"] = _loader_part(work, args.quick, args.reps, args.rounds)
    print(
        f"reading a {gb:g} GB folder ({rss['samples']} samples of {args.seq + 1} tokens, every one "
        f"once, {rss['read_s']:.1f} s): ru_maxrss {rss['ru_maxrss_MB']:.0f} MB; anonymous RSS "
        f"{rss['before_MB']['RssAnon']:.0f} -> {rss['after_read_MB']['RssAnon']:.0f} MB, "
        f"file-backed {rss['before_MB']['RssFile']:.0f} -> {rss['after_read_MB']['RssFile']:.0f} MB "
        "(mapped page cache, reclaimable)"
    )
    out = results_dir(args.publish) / f"data_io{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
