"""The end of a `mesh3d train` run: its plot and a short summary, printed once.

    == run default_20261203_091500: 150 steps in 1m52s ==
    train loss   8.33 -> 4.12 (last step)      validation loss 4.30 (ppl 73.7)
    tokens/s     2,950 (median of logged steps)
    checkpoint   runs/default_20261203_091500/checkpoints/150
    sample       'def __init__(self' -> ...

It speaks of this run only: after a resume, the steps it ran and the checkpoint it saved last.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from mesh3d.log import logger

PROMPT = "def __init__(self"
SAMPLE_MAX_PARAMS = 2e9  # rank 0 loads the model on CPU in fp32 for the sample: 8 GB at most


def finish(cfg, result, metrics_file: str | None) -> None:
    """Write the run's plot and print its summary (world rank 0, after every rank is done)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the metrics owner closed its file
    if (dist.get_rank() if dist.is_initialized() else 0) != 0 or not result.metrics:
        return
    plot = _plot(metrics_file)
    step_dir = result.saved_dir
    lines = summary_lines(cfg, result.metrics, metrics_file, plot, step_dir, result.start_step)
    if getattr(result, "evals", None):
        last = result.evals[-1]
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in last.items()
                          if k.startswith("eval/"))  # fmt: skip
        lines.append(f"evals        step {last['iteration']}: {shown}")
    if getattr(result, "uploads", None) is not None:
        lines.append(f"s3_upload    {result.uploads.line()}")
    if sample := _sample(cfg, step_dir):
        lines.append(f"sample       {sample}")
    print("\n".join(lines), flush=True)


def summary_lines(cfg, metrics: list[dict], metrics_file, plot, step_dir,
                  start_step: int = 0) -> list[str]:  # fmt: skip
    """The summary of a run that ran `metrics` (one per step) after step `start_step` and saved
    `step_dir` last (None: it saved nothing)."""
    first, last = metrics[0], metrics[-1]
    seconds = sum(m.get("elapsed_time_per_iteration_ms", 0.0) for m in metrics) / 1000
    minutes, secs = divmod(int(seconds), 60)
    ran = last["iteration"] - start_step
    resumed = f" (resumed from step {start_step})" if start_step else ""
    lines = [f"== run {cfg.general.run}: {ran} steps in {minutes}m{secs:02d}s{resumed} =="]
    loss = (
        f"train loss   {first['lm_loss']:.3f} (step {first['iteration']}) -> {last['lm_loss']:.3f}"
    )
    if val := [m for m in metrics if "val_loss" in m]:
        loss += f"      validation loss {val[-1]['val_loss']:.3f} (ppl {val[-1]['val_ppl']:.1f})"
    lines.append(loss)
    rates = [m["tokens_per_sec"] for m in metrics[1:] if "tokens_per_sec" in m] or [
        m.get("tokens_per_sec", 0.0) for m in metrics
    ]
    lines.append(f"tokens/s     {statistics.median(rates):,.0f} (median, first step left out)")
    for name, path in (("checkpoint", step_dir), ("metrics", metrics_file), ("plot", plot)):
        if path:
            lines.append(f"{name:<12} {path}")
    return lines


def _plot(metrics_file: str | None) -> Path | None:
    if not metrics_file or not Path(metrics_file).is_file():
        return None
    try:
        from mesh3d.plot import write_plot

        return write_plot([Path(metrics_file)], Path(metrics_file).with_name("metrics.png"))
    except Exception as e:  # no matplotlib, a full disk: the run itself succeeded
        logger.warning(f"no plot written: {e}")
        return None


def _sample(cfg, step_dir: Path | None, new_tokens: int = 24) -> str | None:
    """Greedy text from the last checkpoint, or None without one or a local tokenizer."""
    name = cfg.tokenizer.tokenizer_name_or_path if cfg.tokenizer else None
    if step_dir is None or not name or not Path(name).exists() or cfg.mesh3d.hf_model:
        return None  # (a transformers model's: `mesh3d convert to-hf`, then its own generate)
    itemsize = torch.empty(0, dtype=getattr(torch, cfg.model.dtype)).element_size()
    params = sum(f.stat().st_size for f in (step_dir / "model").rglob("*.safetensors")) / itemsize
    if params > SAMPLE_MAX_PARAMS:  # a big model's fp32 copy could exhaust rank 0's memory
        return (f"skipped ({params / 1e9:.1f}B parameters are too many to load on CPU here): "
                f"mesh3d generate --checkpoint {step_dir} --prompt {PROMPT!r}")  # fmt: skip
    from mesh3d.data.tokenizer import load_tokenizer
    from mesh3d.generation.load import load_model
    from mesh3d.generation.sampling import generate

    tokenizer = load_tokenizer(name)
    model, mc = load_model(step_dir, torch.device("cpu"))
    ids = torch.tensor(tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    out = generate(model, ids, new_tokens, eos=mc.eos_token_id,
                   vocab_size=cfg.model.model_config.vocab_size)  # fmt: skip
    text = tokenizer.decode(out[len(ids) :].tolist())
    return f"{PROMPT!r} -> {text!r}"
