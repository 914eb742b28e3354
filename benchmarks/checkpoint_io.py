"""Checkpoint save and load throughput for a ~1B-parameter Llama on one process, with and
without the checksums (CRC-32 of every file written, verified on load).

    python benchmarks/checkpoint_io.py            # ~1.0B parameters (~19 GiB RAM, ~11 GB disk)
    python benchmarks/checkpoint_io.py --quick    # a 30M-parameter model, seconds

The model (fp32 parameters, AdamW state filled with random values, as after some training) is
saved with mesh3d's `save_checkpoint` — Nanotron's layout: weights, optimizer state with fp32
masters, LR scheduler, random states; fsynced — and loaded back into the same model with
`load_checkpoint` (same code path as a resume at any layout). This is done twice, one after the
other: as mesh3d runs (checksums on), and with the CRC replaced by a no-op and the load's
verification skipped (checksums off), which is what the checksums cost. Reported: seconds and
MB/s of each, bytes on disk against the raw parameter bytes, and a check that the loaded state
equals the saved one. The load reads files that are likely still in the page cache: it measures
mesh3d's work, not the disk. Results go to `benchmarks/results/local/checkpoint_io[_quick].json`
(`--publish`: `benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path when a script runs

import mesh3d.checkpoint.folder as folder
import mesh3d.checkpoint.load as checkpoint_load
from mesh3d.checkpoint.load import load_checkpoint
from mesh3d.checkpoint.training import save_checkpoint
from mesh3d.checks import validate
from mesh3d.config import load_config
from mesh3d.layout import RunLayout
from mesh3d.mesh import ParallelDims, build_mesh
from mesh3d.train.build import build_model_parts
from mesh3d.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
# TinyLlama-1.1B's shapes with 18 layers, untied: 1.00B parameters
FULL = ["model.model_config.hidden_size=2048", "model.model_config.intermediate_size=5632",
        "model.model_config.num_attention_heads=32", "model.model_config.num_key_value_heads=4",
        "model.model_config.num_hidden_layers=18", "model.model_config.vocab_size=32000",
        "model.model_config.tie_word_embeddings=false"]  # fmt: skip
QUICK = ["model.model_config.hidden_size=512", "model.model_config.intermediate_size=1376",
         "model.model_config.num_attention_heads=8", "model.model_config.num_key_value_heads=4",
         "model.model_config.num_hidden_layers=8", "model.model_config.vocab_size=8000",
         "model.model_config.tie_word_embeddings=false"]  # fmt: skip
COMMON = ["model.dtype=float32", "optimizer.accumulate_grad_in_fp32=true", "mesh3d.device=cpu",
          "logging.log_level=warning"]  # fmt: skip
MB = 1e6


def _fill_state(parts, optimizer) -> float:
    """Random AdamW state for every parameter; returns a checksum of params + state."""
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for p in parts.parameters():
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        avg = torch.randn(p.shape, generator=g) * 1e-3
        optimizer.state[p] = {"step": torch.tensor(10.0), "exp_avg": avg, "exp_avg_sq": avg * avg}
        total += float(p.detach().double().sum() + avg.double().sum())
    return total


def _checksum(parts, optimizer) -> float:
    return sum(
        float(p.detach().double().sum() + optimizer.state[p]["exp_avg"].double().sum())
        for p in parts.parameters()
    )


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextlib.contextmanager
def checksums(on: bool):
    """As mesh3d runs (`on`), or with the CRC a no-op and the load's verification skipped."""
    if on:
        yield
        return
    real_zlib, real_verify = folder.zlib, checkpoint_load.verify_everywhere
    folder.zlib = types.SimpleNamespace(crc32=lambda data, crc=0: crc)
    checkpoint_load.verify_everywhere = lambda *args, **kwargs: None
    try:
        yield
    finally:
        folder.zlib, checkpoint_load.verify_everywhere = real_zlib, real_verify


def save_and_load(work: Path, on: bool, cfg, parts, optimizer, scheduler, mesh, before) -> dict:
    """Seconds to save and to load back one checkpoint; the state must come back equal."""
    with checksums(on):
        t0 = time.perf_counter()
        layout = RunLayout.resolve(cfg, 1)
        step_dir = save_checkpoint(
            work / "ckpt", 10, cfg, parts, optimizer, scheduler, mesh, 0, layout=layout
        )
        save_s = time.perf_counter() - t0
        written = _bytes(step_dir)
        folders = {d.name: _bytes(d) for d in sorted(step_dir.iterdir()) if d.is_dir()}
        for p in parts.parameters():  # make sure the load really writes every value
            with torch.no_grad():
                p.zero_()
        optimizer.state.clear()
        t0 = time.perf_counter()
        load_checkpoint(step_dir, parts, optimizer, scheduler, cfg, layout=layout)
        load_s = time.perf_counter() - t0
    after = _checksum(parts, optimizer)
    shutil.rmtree(work / "ckpt")
    return {
        "save_s": save_s, "save_MB_per_s": written / MB / save_s,
        "load_s": load_s, "load_MB_per_s": written / MB / load_s,
        "bytes_written": written, "folders": folders,
        "state_equal_after_load": abs(after - before) <= 1e-9 * max(abs(before), 1.0),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 30M-parameter model")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="save+load pairs per variant (best kept)"
    )
    add_publish_flag(ap)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    print("command:", "python", *map(shlex.quote, sys.argv))
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {datetime.date.today()}")

    overrides = (QUICK if args.quick else FULL) + COMMON + args.overrides
    cfg = load_config(ROOT / "recipes" / "configs" / "cpu_tiny.yaml", overrides)
    validate(cfg, world_size=1)
    work = Path(args.dir or tempfile.mkdtemp(prefix="mesh3d-ckpt-io-"))
    store = dist.FileStore(str(work / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = build_mesh(ParallelDims(1, 1, 1), "cpu")
    parts = build_model_parts(cfg, RunLayout.resolve(cfg, 1), mesh, torch.device("cpu"))
    optimizer, scheduler = build_optimizer(
        parts.named_parameters(), cfg, RunLayout.resolve(cfg, 1), torch.device("cpu")
    )
    n_params = sum(p.numel() for p in parts.parameters())
    before = _fill_state(parts, optimizer)
    print(f"parameters: {n_params / 1e9:.3f}B ({n_params * 4 / 2**30:.2f} GiB fp32)")

    trials: dict[str, list[dict]] = {"checksums": [], "no_checksums": []}
    for _ in range(args.repeats):  # alternating, so a drift of the machine hits both alike
        for name, on in (("checksums", True), ("no_checksums", False)):
            r = save_and_load(work, on, cfg, parts, optimizer, scheduler, mesh, before)
            trials[name].append(r)
    # the fastest of each: the cost of the work itself, with the least of the machine's noise
    runs = {
        name: {**min(rs, key=lambda r: r["save_s"]),
               **{k: v for k, v in min(rs, key=lambda r: r["load_s"]).items() if k.startswith("load")},
               "state_equal_after_load": all(r["state_equal_after_load"] for r in rs),
               "all_save_s": [r["save_s"] for r in rs], "all_load_s": [r["load_s"] for r in rs]}
        for name, rs in trials.items()
    }  # fmt: skip
    on, off = runs["checksums"], runs["no_checksums"]
    raw = n_params * 4
    result = {
        "date": str(datetime.date.today()),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "parameters": n_params,
        "raw_param_bytes_fp32": raw,
        "bytes_written": on["bytes_written"],
        "written_over_raw": on["bytes_written"] / raw,
        "folders": on["folders"],
        "runs": runs,
        "save_time_ratio_checksums_over_none": on["save_s"] / off["save_s"],
        "load_time_ratio_checksums_over_none": on["load_s"] / off["load_s"],
        "state_equal_after_load": on["state_equal_after_load"] and off["state_equal_after_load"],
    }
    print(f"{'best of ' + str(args.repeats):>22} {'seconds':>8} {'MB/s':>8}")
    for name, r in runs.items():
        print(f"{'save, ' + name:>22} {r['save_s']:8.1f} {r['save_MB_per_s']:8.0f}")
        print(f"{'load, ' + name:>22} {r['load_s']:8.1f} {r['load_MB_per_s']:8.0f}")
    print(
        f"time with / without checksums: save {result['save_time_ratio_checksums_over_none']:.3f}, "
        f"load {result['load_time_ratio_checksums_over_none']:.3f}"
    )
    written = on["bytes_written"]
    print(
        f"written {written / 2**30:.2f} GiB = {result['written_over_raw']:.2f} x the fp32 parameters"
        f" ({', '.join(f'{k} {v / 2**30:.2f}' for k, v in result['folders'].items())} GiB)"
    )
    print(f"state equal after load: {result['state_equal_after_load']}")
    out = results_dir(args.publish) / f"checkpoint_io{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0 if result["state_equal_after_load"] else 1


if __name__ == "__main__":
    sys.exit(main())
