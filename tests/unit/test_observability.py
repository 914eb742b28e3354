"""Metrics to every sink with the same values (metrics file, W&B offline, TensorBoard), MFU and
its peak table, the profiler trace, the ETA, a resumed run continuing its W&B run, and one metrics
file per run (a fresh run replaces it, a resumed run cuts it at its start step and appends).

The tests of this subject that need a process group are in
`tests/ranks/test_observability_ranks.py`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from parity import TINY

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.train.metrics import (
    PEAK_BF16_TFLOPS,
    JsonlWriter,
    iteration_metrics,
    llama_flops,
    peak_tflops,
)
from mesh3d.train.sinks import MetricSinks, eta_text


def test_flops_tiny_and_1b_by_hand():
    # cpu_tiny.yaml: L4 h256 nq8 nkv4 F688 V512 S128 B16, term by term
    # (docs/nanotron-layout.md#flops-and-mfu)
    qkv = 2 * 4 * 16 * 128 * 256 * 256 + 2 * 4 * 16 * 128 * 256 * 256  # 2 * nkv * dh = 256
    attn = 2 * (2 * 4 * 16 * 8 * 128 * 32 * 128)
    out = 2 * 4 * 16 * 8 * 128 * 32 * 256
    mlp = 6 * 4 * 16 * 128 * 256 * 688
    head = 2 * 16 * 128 * 256 * 512
    assert qkv + attn + out + mlp + head == 13_488_881_664
    assert llama_flops(4, 256, 8, 4, 688, 512, 128, 16) == 3 * 13_488_881_664
    # Nanotron's config_tiny_llama (HEAD): L28 h2048 nq16 nkv2 F11008 V128256 S4096, GBS 12,
    # as 6 FLOPs per matmul weight per token + 12 L S h attention FLOPs per token
    weights = 28 * (2048 * (16 + 2 * 2) * 128 + 2048 * 2048 + 3 * 2048 * 11008) + 2048 * 128256
    per_token = 6 * weights + 12 * 28 * 4096 * 2048
    assert llama_flops(28, 2048, 16, 2, 11008, 128256, 4096, 12) == 12 * 4096 * per_token


def test_mfu_formula_and_peak_table():
    flops = llama_flops(28, 2048, 16, 2, 11008, 128256, 4096, 12)  # 8.524e14 per step
    m = iteration_metrics(
        iteration=1, consumed_samples=12, seq_len=4096, elapsed_s=2.0, global_batch_size=12,
        world_size=8, lm_loss=1.0, lr=1e-3, step_flops=flops, grad_norm=None, peak=989.4,
    )  # fmt: skip
    assert m["model_tflops_per_gpu"] == pytest.approx(8.52413569302528e14 / (2.0 * 8 * 1e12))
    assert m["mfu"] == pytest.approx(100 * 53.275848081408 / 989.4)  # 5.38 %
    cpu = iteration_metrics(
        iteration=1, consumed_samples=12, seq_len=4096, elapsed_s=2.0, global_batch_size=12,
        world_size=8, lm_loss=1.0, lr=1e-3, step_flops=flops, grad_norm=None, peak=None,
    )  # fmt: skip
    assert "mfu" not in cpu
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA L4") == 121.0 and peak_tflops("NVIDIA L40S") == 362.1
    assert peak_tflops("NVIDIA GeForce RTX 4090") is None and peak_tflops(None) is None
    # a step can never beat the peak: MFU <= 100 % whenever elapsed >= flops / (world * peak)
    for _, peak in PEAK_BF16_TFLOPS:
        fastest = flops / (8 * peak * 1e12)
        m = iteration_metrics(
            iteration=1, consumed_samples=12, seq_len=4096, elapsed_s=fastest,
            global_batch_size=12, world_size=8, lm_loss=1.0, lr=1e-3, step_flops=flops,
            grad_norm=None, peak=peak,
        )  # fmt: skip
        assert m["mfu"] == pytest.approx(100.0)


def test_eta_format():
    assert eta_text(65) == "0:01:05"
    assert eta_text(91_530) == "1 day, 1:25:30"


def _iterations(path: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def _old_run(path: Path, steps: int, tail: str = "") -> None:
    """A metrics file an earlier run left: iterations 1..steps (loss 10 - i/10), then `tail`."""
    lines = [
        json.dumps({"iteration": i, "lm_loss": 10 - i / 10}) + "\n" for i in range(1, steps + 1)
    ]
    path.write_text("".join(lines) + tail)


def _sinks(path: Path, start_step: int) -> MetricSinks:
    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), ["mesh3d.wandb=false"])
    return MetricSinks(cfg, True, str(path), start_step=start_step)


def test_a_fresh_run_replaces_the_metrics_file(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    _old_run(path, 15)
    sinks = _sinks(path, start_step=0)
    assert path.read_text() == ""  # replaced at start, before the first record
    for i in range(1, 6):
        sinks.write({"iteration": i, "lm_loss": 1.0 / i}, [0.1])
    sinks.close()
    assert _iterations(path) == [1, 2, 3, 4, 5]
    assert [p.name for p in path.parent.iterdir()] == ["metrics.jsonl"]  # no temp file left


def test_a_resumed_run_continues_its_own_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _old_run(path, 15, tail='{"iteration": 16, "lm_lo')  # the earlier run was killed mid-line
    kept = path.read_text().splitlines(keepends=True)[:10]
    sinks = _sinks(path, start_step=10)
    assert path.read_text() == "".join(kept)  # 1..10 byte for byte; 11..15 and the cut line gone
    for i in (11, 12):
        sinks.write({"iteration": i, "lm_loss": 0.5}, [0.1])
    sinks.close()
    assert _iterations(path) == list(range(1, 13))
    assert [json.loads(x)["lm_loss"] for x in path.read_text().splitlines()][9:] == [9.0, 0.5, 0.5]

    elsewhere = tmp_path / "new" / "metrics.jsonl"  # resumed into a file that does not exist yet
    writer = JsonlWriter(elsewhere, start_step=10)
    writer.write({"iteration": 11})
    writer.close()
    assert _iterations(elsewhere) == [11]


def test_only_the_metrics_rank_touches_the_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _old_run(path, 3)
    cfg = config_from_dict(copy.deepcopy(TINY))
    MetricSinks(cfg, False, str(path)).write({"iteration": 1, "lm_loss": 1.0}, [0.1])
    assert _iterations(path) == [1, 2, 3]


def test_the_end_of_run_sample_skips_a_model_too_big_for_cpu(tmp_path, monkeypatch):
    # rank 0 would load the whole model on CPU in fp32 for the summary's sample: a model past
    # SAMPLE_MAX_PARAMS is named with the command that samples it instead, and nothing is loaded
    from mesh3d import summary

    raw = copy.deepcopy(TINY)
    raw["tokenizer"] = {"tokenizer_name_or_path": str(tmp_path)}  # local: a sample is due
    raw["model"]["dtype"] = "bfloat16"
    cfg = config_from_dict(raw)
    step = tmp_path / "checkpoints" / "7"
    (step / "model").mkdir(parents=True)
    (step / "model" / "w.safetensors").write_bytes(b"\0" * 3000)  # 1,500 bf16 values
    monkeypatch.setattr(summary, "SAMPLE_MAX_PARAMS", 1000)
    got = summary._sample(cfg, step)
    assert got.startswith("skipped (0.0B parameters are too many to load on CPU here)"), got
    assert f"mesh3d generate --checkpoint {step} --prompt 'def __init__(self'" in got
    monkeypatch.setattr(summary, "SAMPLE_MAX_PARAMS", 2000)  # under the bound: it loads
    with pytest.raises(Exception, match="no tokenizer.json"):  # (it went on to load one)
        summary._sample(cfg, step)
