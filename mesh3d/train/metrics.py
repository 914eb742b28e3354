"""Per-iteration metrics: Nanotron's FLOPs formula, its number format, its log line
(docs/nanotron-layout.md#the-iteration-log-line) and the `--metrics-file` writer."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from pathlib import Path

from mesh3d.errors import unwritable
from mesh3d.log import logger

_SUFFIXES = ["", "K", "M", "G", "T", "P", "E"]


def human_format(x: float) -> str:
    """Nanotron's `human_format` (CLASSIC suffixes): 1024 -> '1.02K', 0.00015 -> '0.00015'."""
    if abs(x) < 1:
        return f"{x:.3g}"
    x = float(f"{x:.3g}")
    i = 0
    while abs(x) >= 1000 and i < len(_SUFFIXES) - 1:
        x /= 1000.0
        i += 1
    return f"{x:f}".rstrip("0").rstrip(".") + _SUFFIXES[i]


def llama_flops(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                ffn_size: int, vocab_size: int, seq_len: int, batch_size: int) -> float:  # fmt: skip
    """Model FLOPs of one Llama training step (docs/nanotron-layout.md#flops-and-mfu), from
    plain sizes: `vocab_size` padded, `batch_size` the global batch."""
    from mesh3d.models.registry import spec_named
    from mesh3d.models.spec import ModelShape

    shape = ModelShape(
        num_layers, hidden_size, ffn_size, num_heads, num_kv_heads, vocab_size, False
    )
    return spec_named("llama").step_flops(shape, seq_len, batch_size)


# Dense bf16 tensor-core peak, TFLOPs per device (vendor data sheets; no sparsity). Matched in
# order against `torch.cuda.get_device_name()`; anything else (and the CPU) gets no MFU.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"H100.*PCIe", 756.0), (r"H100.*NVL", 835.0), (r"GH200", 989.4), (r"H100|H800", 989.4),
    (r"H200", 989.4), (r"B200", 2250.0), (r"A100|A800", 312.0), (r"L40S", 362.1),
    (r"\bL4\b", 121.0), (r"MI300X", 1307.4), (r"MI250X", 383.0),
]  # fmt: skip


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a known accelerator, or None (unknown device, CPU)."""
    hits = (peak for pattern, peak in PEAK_BF16_TFLOPS if re.search(pattern, device_name or ""))
    return next(hits, None) if device_name else None


def iteration_metrics(*, iteration: int, consumed_samples: int, seq_len: int, elapsed_s: float,
                      global_batch_size: int, world_size: int, lm_loss: float, lr: float,
                      step_flops: float, grad_norm: float | None, peak: float | None = None,
                      consumed_tokens: int | None = None) -> dict:  # fmt: skip
    """The metrics record of one iteration, keys and order as Nanotron's CLASSIC log line.
    `consumed_tokens` defaults to consumed_samples x seq_len; `mfu` only when `peak` is known."""
    tokens_per_sec = global_batch_size * seq_len / elapsed_s
    tflops = step_flops / (elapsed_s * world_size * 1e12)
    tokens = consumed_samples * seq_len if consumed_tokens is None else consumed_tokens
    m = {
        "iteration": iteration,
        "consumed_tokens": tokens,
        "elapsed_time_per_iteration_ms": elapsed_s * 1000.0,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_gpu": tokens_per_sec / world_size,
        "global_batch_size": global_batch_size,
        "lm_loss": lm_loss,
        "lr": lr,
        "model_tflops_per_gpu": tflops,
        "hardware_tflops_per_gpu": tflops,
    }
    if grad_norm is not None:
        m["grad_norm"] = grad_norm
    if peak:
        m["mfu"] = 100.0 * tflops / peak
    return m


def peak_memory() -> dict:
    """Peak memory of this process: CUDA allocated/reserved (MiB) on CUDA, peak RSS on CPU."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
        }
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def memory_metrics() -> dict:
    """Nanotron's extra items for the first steps: CUDA memory and disk usage of `/`. The
    `hd_*_memory_tb` keys hold terabytes (10**12 bytes), as named; Nanotron's held bytes."""
    import torch

    m = {}
    if torch.cuda.is_available():
        m["cuda_memory_allocated"] = torch.cuda.memory_allocated()
        m["cuda_max_memory_reserved"] = torch.cuda.max_memory_reserved()
    du = shutil.disk_usage("/")
    return m | {"hd_total_memory_tb": du.total / 1e12, "hd_used_memory_tb": du.used / 1e12,
                "hd_free_memory_tb": du.free / 1e12}  # fmt: skip


def format_iteration_line(m: dict, train_steps: int) -> str:
    """`iteration: 3 / 15 | consumed_tokens: 3.07K | ...` (every value through human_format)."""
    items = [f"iteration: {m['iteration']} / {train_steps}"]
    items += [f"{k}: {human_format(v) if math.isfinite(v) else v}" for k, v in m.items()
              if k != "iteration"]  # fmt: skip
    return " | ".join(items)


class JsonlWriter:
    """The `--metrics-file`: one JSON object per iteration, flushed each line; one file per run.
    A resumed run keeps the records with `iteration <= start_step`, written to
    `<path>.<pid>.tmp` and renamed over `path` (a crash at start never leaves a mix)."""

    def __init__(self, path: str | os.PathLike, start_step: int = 0):
        path = Path(path)
        tmp = path.parent / f"{path.name}.{os.getpid()}.tmp"  # two runs started the same second
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _lines_up_to(path, start_step) if start_step > 0 and path.is_file() else []
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
            self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the run
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise unwritable("--metrics-file", path, e, "choose a file you can write") from None

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _lines_up_to(path: Path, start_step: int) -> list[str]:
    """The lines of `path` whose record has `iteration <= start_step`, newline-terminated; lines
    that are not JSON records (cut off when the earlier run was killed) are dropped."""
    kept, later, broken = [], 0, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            iteration = record["iteration"]
        except (ValueError, TypeError, KeyError):
            broken += int(bool(line.strip()))
            continue
        if iteration <= start_step:
            kept.append(line + "\n")
        else:
            later += 1
    dropped = [f"{later} records past step {start_step}"] * bool(later)
    dropped += [f"{broken} lines that are not JSON records"] * bool(broken)
    if dropped:
        logger.info(
            f"metrics file {path}: resuming at step {start_step}, kept {len(kept)} records, "
            f"dropped {' and '.join(dropped)}"
        )
    return kept
