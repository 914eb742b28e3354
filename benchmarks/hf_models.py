"""A `transformers` model trained through mesh3d (`parallelize_hf`) against the same model in a
plain loop, and against mesh3d's own family of the same architecture (issue 47's measure).

    python benchmarks/hf_models.py            # ~4 min on 2 cores
    python benchmarks/hf_models.py --tiny     # toy shapes, seconds

Shapes: the Llama of `benchmarks/throughput.py`'s "quick" mode (hidden 512, 4 layers, 8 heads,
4 key/value heads, vocabulary 4096, 2 x 2 sequences of 256 tokens a step), fp32, SDPA, one
intra-op thread per rank. Every way starts from the same weights and trains on the same batches
with AdamW and gradient clipping; their steps are interleaved round by round (the order rotating)
so a shared machine's drifts hit each alike. Ways:

  1x1x1, one process:
    hf_plain   transformers' LlamaForCausalLM in a plain loop (torch's cross-entropy) - the base
    hf_mesh3d  the same model saved to a folder and trained by mesh3d's own run of it
               (`mesh3d.hf_model`: `Run.prepare` / `run.step`, what `mesh3d train` steps)
    family     mesh3d's own Llama run of the same config
  tp 2, two ranks:
    hf_mesh3d  mesh3d's run of the folder at tp 2 (the model's own TP plan, vocab-parallel head)
    family     mesh3d's Llama run at tp 2

Reported: median tokens/s after the warm-up rounds and the median of the per-round ratios with a
bootstrap 95% interval. Target (issue 47): hf_mesh3d / hf_plain >= 0.98 at 1x1x1.
Results: benchmarks/results/local/hf_models[_tiny].json (`--publish`: benchmarks/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import tempfile

import torch
from _ranks import launch
from _results import add_publish_flag, print_header, results_dir
from _ways import (
    COMMON,
    CONFIG,
    hf_model,
    loop_stepper,
    mesh3d_stepper,
    plain_model,
    shape_overrides,
    step_batches,
)
from throughput import bootstrap_median, interleave

from mesh3d.config import global_batch_size, load_config


def _config(mode: str, tp: int = 1):
    return load_config(CONFIG, [*COMMON, *shape_overrides(mode), f"parallelism.tp={tp}"])


def write_folder(mode: str, folder: str) -> None:
    """transformers' LlamaForCausalLM with the weights of `mode`'s mesh3d Llama, saved in
    `folder` (before any rank starts: saving inside a rank's process group skips ranks > 0)."""
    cfg = _config(mode)
    hf_model(cfg, plain_model(cfg).state_dict()).save_pretrained(folder)


def hf_config(mode: str, folder: str, tp: int = 1):
    """The run of `mode`'s config with its model the folder's: what `mesh3d train
    mesh3d.hf_model=FOLDER` trains."""
    return load_config(CONFIG, [*COMMON, *shape_overrides(mode), f"parallelism.tp={tp}",
                                f"mesh3d.hf_model={folder}", "parallelism.tp_mode=ALL_REDUCE"])  # fmt: skip


def _summary(out: dict, base: str, tokens: int, warmup: int) -> dict:
    rows = {}
    for name, m in out.items():
        m["tokens_per_sec_median"] = statistics.median(
            tokens / s for s in m["step_seconds"][warmup:]
        )
        if name == base:
            continue
        per_round = [b / a for a, b in zip(m["step_seconds"], out[base]["step_seconds"])][warmup:]
        rows[f"{name}_over_{base}"] = {"paired": statistics.median(per_round),
                                       "ci95": bootstrap_median(per_round)}  # fmt: skip
    return rows


def one_process(mode: str, rounds: int, warmup: int, folder: str) -> dict:
    torch.set_num_threads(1)
    cfg = _config(mode)
    steps = step_batches(cfg, rounds)
    weights = plain_model(cfg).state_dict()
    ways = {"hf_plain": loop_stepper(hf_model(cfg, weights),
                                     lambda m, x: m(input_ids=x, use_cache=False).logits, cfg, steps),
            "family": mesh3d_stepper(cfg)}  # fmt: skip
    ways["hf_mesh3d"] = mesh3d_stepper(hf_config(mode, folder))
    out = interleave(ways, rounds)
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    return {"ways": out, "ratios": _summary(out, "hf_plain", tokens, warmup),
            "first_losses": {n: m["losses"][0] for n, m in out.items()}}  # fmt: skip


def _tp2_rank(rank: int, world: int, mode: str, rounds: int, folder: str):
    ways = {"family": mesh3d_stepper(_config(mode, tp=2)),
            "hf_mesh3d": mesh3d_stepper(hf_config(mode, folder, tp=2))}  # fmt: skip
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
    with quiet:  # rank 0 prints the rounds
        return interleave(ways, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes, few rounds")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 12; --tiny 4)")
    add_publish_flag(ap)
    a = ap.parse_args()
    head = print_header()
    mode = "tiny" if a.tiny else "quick"
    rounds = a.rounds or (4 if a.tiny else 12)
    warmup = 1 if a.tiny else 2
    tokens = global_batch_size(_config(mode)) * _config(mode).tokens.sequence_length
    folder = tempfile.mkdtemp(prefix="mesh3d-hf-")
    write_folder(mode, folder)
    print("== tp 2, two ranks")  # first: forked ranks must not inherit a process group
    tp2 = launch(2, _tp2_rank, mode, rounds, folder, timeout=1800)[0]
    print(f"== 1x1x1, one process ({mode} shapes, {tokens} tokens a step)")
    single = one_process(mode, rounds, warmup, folder)
    shutil.rmtree(folder, ignore_errors=True)
    tp2_ratios = _summary(tp2, "family", tokens, warmup)
    result = {**head, "mode": mode, "rounds": rounds, "warmup": warmup, "single": single,
              "tp2": {"ways": tp2, "ratios": tp2_ratios}}  # fmt: skip
    print("\n| layout | way | tokens/s (median) | ratio (paired median, 95% CI) |")
    print("|---|---|---:|---|")
    for label, ways, ratios, base in (("1x1x1", single["ways"], single["ratios"], "hf_plain"),
                                      ("tp 2", tp2, tp2_ratios, "family")):  # fmt: skip
        for name, m in ways.items():
            r = ratios.get(f"{name}_over_{base}")
            text = (
                "base"
                if r is None
                else f"{r['paired']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] / {base}"
            )
            print(f"| {label} | {name} | {m['tokens_per_sec_median']:,.0f} | {text} |")
    fam = single["ways"]["family"]["tokens_per_sec_median"]
    hf = single["ways"]["hf_mesh3d"]["tokens_per_sec_median"]
    print(f"1x1x1 hf_mesh3d / family (medians): {hf / fam:.3f}")
    print(f"target hf_mesh3d / hf_plain >= 0.98 at 1x1x1: "
          f"{single['ratios']['hf_mesh3d_over_hf_plain']['paired']:.3f}")  # fmt: skip
    path = results_dir(a.publish) / f"hf_models{'_tiny' if a.tiny else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
