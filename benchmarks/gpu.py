"""Single-GPU training throughput of a 1.1B Llama in bf16 at sequence 2048: tokens/s, MFU, memory.

    bash benchmarks/gpu.sh                      # on a GPU machine; a few minutes
    python benchmarks/gpu.py --dry-run          # no GPU needed: the variants and their configs
    python benchmarks/gpu.py --smoke            # every code path on CPU with a toy model
    python benchmarks/gpu.py --smoke --only docs --only float8    # some variants only

Shapes: TinyLlama-1.1B (hidden 2048, ffn 5632, 22 layers, 32 heads, 4 kv heads, vocab 32000,
untied embeddings; 1.10B parameters), micro batch 4 x 2048 tokens, 2 microbatches per step.
Precision as Nanotron's `model.dtype: bfloat16` with `optimizer.accumulate_grad_in_fp32: true`:
fp32 master parameters and gradients, matmuls under bf16 autocast, fused AdamW.

Variants (each on a fresh model; one that fails is reported and the others still run):
- mesh3d: `mesh3d.train.loop.train` on one rank (the real path), `mesh3d.attention` sdpa, and
  flash when flash-attn imports, and with `mesh3d.compile: true` (each layer's attention,
  MLP and norms compiled by `torch.compile`); with `mesh3d.float8: true` (torchao's float8
  linear layers), eager and compiled, when torchao imports.
- mesh3d at tp=2 on 2 GPUs (torchrun, `recipes/train.py`), compiled, and with
  `mesh3d.async_tp: true`; reported as skipped on a machine with one GPU.
- plain: a hand-written loop over the same model class (`mesh3d.models.llama.Llama`), same
  precision, loss, clipping and optimizer, eager and with `torch.compile` on every decoder layer;
  and eager on packed documents (an EOS every ~512 tokens, `positions` restarting per document):
  document-masked attention, which flash-attn runs with its variable-length kernel and SDPA with
  a boolean mask (compare with the causal row of the same attention).
Reported per variant: median tokens/s after the warm-up steps, MFU (model FLOPs of
`mesh3d.train.metrics.llama_flops` over the bf16 peak of `peak_tflops`; mesh3d's own `mfu`
metric for mesh3d) and peak CUDA memory allocated. Raw numbers: `benchmarks/results/local/gpu.json`
(`--publish`: `benchmarks/results/gpu.json`).
Without a GPU (and without --dry-run / --smoke) it says so and exits 0. Works on torch >= 2.6.
`--smoke` runs every variant on CPU (tp=2 as 2 gloo ranks; async TP is refused there, as it
needs CUDA, and that refusal is the check).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _results import add_publish_flag, results_dir  # benchmarks/ is on sys.path when a script runs
from _ways import torchrun_train

from mesh3d.checks import validate
from mesh3d.checks.speed import torchao_missing
from mesh3d.config import global_batch_size, load_config, padded_vocab_size
from mesh3d.data.build import build_dataset
from mesh3d.data.documents import document_positions, mask_document_starts
from mesh3d.data.dummy import microbatches
from mesh3d.errors import ConfigError
from mesh3d.models.init import init_weights
from mesh3d.models.llama import Llama, flash_attn_func, num_params
from mesh3d.train.loop import train
from mesh3d.train.metrics import llama_flops, peak_tflops

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes/configs/cpu_tiny.yaml"
MC = "model.model_config"
TINYLLAMA = [f"{MC}.hidden_size=2048", f"{MC}.intermediate_size=5632",
             f"{MC}.num_hidden_layers=22", f"{MC}.num_attention_heads=32",
             f"{MC}.num_key_value_heads=4", f"{MC}.vocab_size=32000",
             f"{MC}.max_position_embeddings=2048", f"{MC}.tie_word_embeddings=false",
             "tokens.sequence_length=2048", "tokens.micro_batch_size=4",
             "tokens.batch_accumulation_per_replica=2"]  # fmt: skip
SMOKE = [f"{MC}.hidden_size=128", f"{MC}.intermediate_size=352", f"{MC}.num_hidden_layers=2",
         f"{MC}.num_attention_heads=4", f"{MC}.num_key_value_heads=2", f"{MC}.vocab_size=512",
         f"{MC}.max_position_embeddings=64", f"{MC}.tie_word_embeddings=false",
         "tokens.sequence_length=64", "tokens.micro_batch_size=2",
         "tokens.batch_accumulation_per_replica=2"]  # fmt: skip
COMMON = ["model.dtype=bfloat16", "optimizer.accumulate_grad_in_fp32=true",
          "model.make_vocab_size_divisible_by=1", "mesh3d.dummy_data=random", "mesh3d.wandb=false",
          "logging.log_level=warning", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
          "optimizer.learning_rate_scheduler.learning_rate=0.0003"]  # fmt: skip


EOS, MEAN_DOC = 2, 512  # the packed-documents variants: an EOS every ~MEAN_DOC tokens


@dataclass(frozen=True)
class Variant:
    name: str
    way: str  # mesh3d | plain
    attention: str = "sdpa"
    compiled: bool = False
    docs: bool = False  # plain loop on packed documents (document-masked attention)
    ranks: int = 1  # > 1: mesh3d through torchrun, tp = ranks, one GPU each
    extra: tuple[str, ...] = ()  # more config overrides


def variants() -> list[Variant]:
    """Every variant; flash ones where flash-attn imports, float8 ones where torchao does."""
    attentions = ["sdpa"] + (["flash"] if flash_attn_func is not None else [])
    out = [Variant(f"mesh3d {a}", "mesh3d", a) for a in attentions]
    out.append(Variant("mesh3d sdpa compile", "mesh3d", compiled=True))
    if not torchao_missing():
        f8 = ("mesh3d.float8=true",)
        out.append(Variant("mesh3d sdpa float8", "mesh3d", extra=f8))
        out.append(Variant("mesh3d sdpa float8 compile", "mesh3d", compiled=True, extra=f8))
    for mode in ("selective", "full"):  # what each recompute mode costs at this shape
        out.append(Variant(f"mesh3d sdpa recompute {mode}", "mesh3d",
                           extra=(f"mesh3d.recompute={mode}",)))  # fmt: skip
    tp2 = ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER")  # what async TP overlaps
    out.append(Variant("mesh3d tp2 compile", "mesh3d", compiled=True, ranks=2, extra=tp2))
    out.append(Variant("mesh3d tp2 compile async", "mesh3d", compiled=True, ranks=2,
                       extra=(*tp2, "mesh3d.async_tp=true")))  # fmt: skip
    for compiled in (False, True):
        tag = " compile" if compiled else ""
        out += [Variant(f"plain {a}{tag}", "plain", a, compiled) for a in attentions]
    out += [Variant(f"plain {a} docs", "plain", a, docs=True) for a in attentions]
    return out


def make_config(shape: list[str], device: str, steps: int, v: Variant, extra):
    """The config of variant `v`; its `compiled` sets `mesh3d.compile` for mesh3d variants (the
    plain loop calls torch.compile itself)."""
    compiled = v.compiled and v.way == "mesh3d"
    overrides = [*COMMON, *shape, f"mesh3d.device={device}", f"tokens.train_steps={steps}",
                 f"mesh3d.attention={v.attention}", f"mesh3d.compile={str(compiled).lower()}",
                 *v.extra, *extra]  # fmt: skip
    return load_config(CONFIG, overrides), overrides


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mesh3d(cfg, ranks: int, overrides: list[str], device: torch.device):
    """(seconds, mfu %) per step of mesh3d's own training loop, in this process or on `ranks`
    torchrun ranks; raises ConfigError if refused."""
    validate(cfg, world_size=ranks)  # a refused config is reported, not run
    if ranks == 1:
        metrics = train(cfg).metrics
    elif device.type == "cuda" and torch.cuda.device_count() < ranks:
        raise Skipped(f"needs {ranks} GPUs, {torch.cuda.device_count()} visible")
    else:
        metrics, _ = torchrun_train(ranks, overrides)
    seconds = [m["elapsed_time_per_iteration_ms"] / 1000 for m in metrics]
    return seconds, [m.get("mfu") for m in metrics]


def reason(e: ConfigError) -> str:
    """The line of a config error that says what is wrong."""
    return str(e).splitlines()[-1].strip(" -")


class Skipped(Exception):
    """A variant this machine cannot run (not enough GPUs)."""


def plain_model(cfg, device: torch.device, compiled: bool) -> Llama:
    """The same model class and initial weights, fp32 master parameters on `device`."""
    mc, init = cfg.model.model_config, cfg.model.init_method
    model = Llama(mc, vocab_size=padded_vocab_size(cfg), attention=cfg.mesh3d.attention)
    scaling = getattr(init, "scaling_method", "NUM_LAYERS")
    init_weights(model, init.std, mc.num_hidden_layers, scaling, seed=cfg.general.seed)
    model.to(device)
    if compiled:
        for layer in model.layers.values():  # the same graph for every layer: compiled once
            layer.compile()
    return model


def run_plain(cfg, device: torch.device, compiled: bool, docs: bool) -> list[float]:
    """Seconds per step of a hand-written loop: bf16 autocast, fp32 loss, clip, fused AdamW;
    `docs`: on packed documents (rows of ~MEAN_DOC-token documents, document-masked attention)."""
    model = plain_model(cfg, device, compiled)
    o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.learning_rate_scheduler.learning_rate,
        betas=(f.adam_beta1, f.adam_beta2), eps=f.adam_eps, weight_decay=o.weight_decay,
        fused=device.type == "cuda",
    )  # fmt: skip
    data, gbs = build_dataset(cfg, 0), global_batch_size(cfg)
    tokens = gbs * cfg.tokens.sequence_length
    seconds = []
    g = torch.Generator().manual_seed(0)
    for step in range(1, cfg.tokens.train_steps + 1):
        batches = microbatches(data, step, gbs, 0, 1, cfg.tokens.micro_batch_size)
        sync(device)
        t0 = time.time()
        for inputs, labels in batches:
            kwargs = {}
            if docs:  # packed documents: an EOS every ~MEAN_DOC tokens, positions restart after it
                ends = torch.rand(inputs.shape, generator=g) < 1 / MEAN_DOC
                inputs = torch.where(ends, torch.full_like(inputs, EOS), inputs)
                labels = mask_document_starts(torch.roll(inputs, -1, 1), inputs, EOS)
                kwargs["positions"] = document_positions(inputs, EOS).to(device)
            inputs, labels = inputs.to(device), labels.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(inputs, **kwargs)  # (B, S, V) bf16
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        seconds.append(time.time() - t0)
    return seconds


def measure(v: Variant, cfg, overrides: list[str], device: torch.device, warmup: int) -> dict:
    """One variant: tokens/s, MFU and peak memory, or the reason it did not run."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    mc, gbs, seq = cfg.model.model_config, global_batch_size(cfg), cfg.tokens.sequence_length
    flops = llama_flops(mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
                        mc.num_key_value_heads, mc.intermediate_size, padded_vocab_size(cfg),
                        seq, gbs)  # fmt: skip
    peak = peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    row: dict = dict(variant=v.name)
    t0 = time.time()
    try:
        if v.way == "mesh3d":
            seconds, mfus = run_mesh3d(cfg, v.ranks, overrides, device)
        else:
            seconds = run_plain(cfg, device, v.compiled, v.docs)
            mfus = [100 * flops / (s * 1e12) / peak if peak else None for s in seconds]
    except ConfigError as e:
        return dict(row, status="refused", reason=reason(e))
    except Skipped as e:
        return dict(row, status="skipped", reason=str(e))
    except Exception as e:  # one failing variant (OOM, compile) must not stop the rest
        return dict(row, status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
    kept = seconds[warmup:] or seconds
    median_s = statistics.median(kept)
    mfu = statistics.median(m for m in mfus[warmup:] or mfus) if peak else None
    row.update(status="ok", tokens_per_sec=gbs * seq / median_s, step_s=median_s, mfu=mfu,
               tflops=flops / median_s / 1e12, step_seconds=seconds, wall_s=time.time() - t0)  # fmt: skip
    if device.type == "cuda" and v.ranks == 1:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def table(rows: list[dict]) -> str:
    lines = ["| variant | tokens/s | step s | TFLOP/s | MFU % | peak GiB | note |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | | | | | | {r['status']}: {r['reason']} |")
            continue
        mfu = f"{r['mfu']:.1f}" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "n/a"
        lines.append(f"| {r['variant']} | {r['tokens_per_sec']:.0f} | {r['step_s']:.3f} | "
                     f"{r['tflops']:.1f} | {mfu} | {mem} | |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no GPU needed")
    ap.add_argument("--smoke", action="store_true", help="every variant on CPU, toy shapes")
    ap.add_argument("--steps", type=int, default=8, help="steps per variant (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out (default 3)")
    ap.add_argument("--only", action="append", metavar="TEXT",
                    help="run only the variants whose name contains TEXT (repeatable)")  # fmt: skip
    add_publish_flag(ap)
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides, key=value")
    args = ap.parse_args(argv)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"torch {torch.__version__} | cores {os.cpu_count()} | {now}")
    has_gpu = torch.cuda.is_available()
    if not (has_gpu or args.dry_run or args.smoke):
        print(f"no CUDA GPU visible to torch {torch.__version__}: nothing to measure. Run "
              "`bash benchmarks/gpu.sh` on a GPU machine (or --dry-run / --smoke here).")  # fmt: skip
        return 0
    device = torch.device("cuda" if has_gpu and not args.smoke else "cpu")
    shape = SMOKE if args.smoke else TINYLLAMA
    steps, warmup = (3, 1) if args.smoke else (args.steps, args.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name} | flash-attn: {'yes' if flash_attn_func is not None else 'no'} | "
          f"torchao: {'no' if torchao_missing() else 'yes'}")  # fmt: skip
    plan = [v for v in variants() if not args.only or any(t in v.name for t in args.only)]
    if not plan:
        names = ", ".join(v.name for v in variants())
        print(f"error: no variant's name contains {' or '.join(args.only)}; the variants: {names}")
        return 2
    cfg, overrides = make_config(shape, device.type, steps, Variant("", "mesh3d"), args.overrides)
    mc, gbs, seq = cfg.model.model_config, global_batch_size(cfg), cfg.tokens.sequence_length
    with torch.device("meta"):
        n_params = num_params(Llama(mc, vocab_size=padded_vocab_size(cfg)))
    print(f"config: {CONFIG.relative_to(ROOT)} + {' '.join(overrides)}")
    print(f"model: {n_params / 1e9:.3f}B parameters; {gbs} x {seq} = {gbs * seq} tokens per step; "
          f"{steps} steps per variant, the first {warmup} left out\n")  # fmt: skip
    if args.dry_run:
        for v in plan:
            try:
                c, _ = make_config(shape, device.type, steps, v, args.overrides)
                validate(c, world_size=v.ranks)
                status = "config valid"
            except ConfigError as e:
                status = "refused: " + reason(e)
            print(f"{v.name:>26}: {v.way}, attention {v.attention}, compile {v.compiled}, "
                  f"documents {v.docs}, ranks {v.ranks} ({status})")  # fmt: skip
        return 0
    rows = []
    for v in plan:
        try:
            c, v_overrides = make_config(shape, device.type, steps, v, args.overrides)
            rows.append(measure(v, c, v_overrides, device, warmup))
        except ConfigError as e:  # a key this mesh3d does not know
            rows.append(dict(variant=v.name, status="refused", reason=reason(e)))
        r = rows[-1]
        done = f"{r['tokens_per_sec']:.0f} tokens/s" if r["status"] == "ok" else r["status"]
        print(f"{v.name:>26}: {done} ({r.get('wall_s', 0):.0f}s)", flush=True)
    print("\n" + table(rows))
    if device.type == "cuda":
        out = results_dir(args.publish) / "gpu.json"
        meta = dict(command=sys.argv, torch=torch.__version__, device=name, date=now,
                    parameters=n_params, tokens_per_step=gbs * seq, overrides=overrides)  # fmt: skip
        out.write_text(json.dumps({**meta, "variants": rows}, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
