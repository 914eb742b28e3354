"""`mesh3d/plan/kernels.py`: compute priced by kernel class scales as the parallelism says (tp
with and without sequence parallelism, recompute modes, float8, compile), its matmul FLOPs are
the layer's parameters x 6, and its byte constants are the ones benchmarks/kernel_bytes.py
published."""

import json
from pathlib import Path

import pytest
from test_plan import CPU_TINY

from mesh3d.config import load_config
from mesh3d.models.registry import model_shape, spec_of
from mesh3d.plan import kernels
from mesh3d.plan.hardware import PROFILES
from mesh3d.plan.kernels import compute_seconds, work_of

L8B = ["model.model_config.hidden_size=4096", "model.model_config.intermediate_size=14336",
       "model.model_config.num_hidden_layers=32", "model.model_config.num_attention_heads=32",
       "model.model_config.num_key_value_heads=8", "model.model_config.vocab_size=128256",
       "model.model_config.tie_word_embeddings=false",
       "model.model_config.max_position_embeddings=8192", "tokens.sequence_length=8192"]  # fmt: skip
H100 = PROFILES["h100-80g"]


def _work(kind: str = "eager"):
    cfg = load_config(CPU_TINY, L8B)
    return work_of(spec_of(cfg.model.model_config), model_shape(cfg), 8192, 2, kind)


def _seconds(w, tp=1, sp=False, recomputed=0, mode="none", float8=False, hw=H100, head=True):
    return compute_seconds(w, hw, "bfloat16", 16384, 32, recomputed, head, tp, sp, mode, float8)


def test_matmul_and_attention_flops_of_llama_8b():
    w = _work()
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v; MLP
    assert w.layer_matmul == pytest.approx(6 * per_layer)
    assert w.head_matmul == pytest.approx(6 * 4096 * 128256)
    assert w.attention_fwd == pytest.approx(2 * 4096 * 8192)  # causal: half of 4·q·S


def test_tp_splits_everything_only_with_sequence_parallelism():
    w = _work()
    one = _seconds(w)
    assert _seconds(w, tp=2, sp=True) == pytest.approx(one / 2)
    assert one / 2 < _seconds(w, tp=2, sp=False) < one  # norms, residual kernels: on every rank


def test_recompute_modes_cost_what_they_rerun():
    w = _work()
    none = _seconds(w)
    selective = _seconds(w, recomputed=32, mode="selective")
    full = _seconds(w, recomputed=32, mode="full")
    assert none < selective < full
    # full reruns the forward of everything: matmuls (a third of theirs), attention (1 of
    # 3.5), the memory-bound kernels' forward bytes; selective only the last
    hw, peak = H100, H100.peak("bfloat16")
    matmul = 16384 * 32 * w.layer_matmul / 3 / (peak * hw.efficiency)
    attention = 16384 * 32 * w.attention_fwd / (peak * hw.attention_efficiency)
    assert full - selective == pytest.approx(matmul + attention)
    moved = 16384 * 32 * (w.bytes_h[0] + w.bytes_tp[0]) / hw.memory_bytes_per_s()
    assert selective - none == pytest.approx(moved)
    half = _seconds(w, recomputed=16, mode="full")  # recompute_every 2
    assert half - none == pytest.approx((full - none) / 2)


def test_float8_and_compile_are_faster_where_they_apply():
    w = _work()
    assert _seconds(w, float8=True) < _seconds(w)
    a100 = PROFILES["a100-80g"]  # no float8 peak: unchanged
    assert _seconds(w, float8=True, hw=a100) == _seconds(w, hw=a100)
    assert _seconds(_work("compiled")) < _seconds(_work("compiled_tp")) < _seconds(w)


def test_constants_are_the_published_counts():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernel_bytes.json"
    counted = json.loads(path.read_text())
    for kind, parts in kernels.LAYER_BYTES.items():
        for part, coef in parts.items():
            got = counted["layer"][f"{kind}_{part}"]
            assert coef == pytest.approx((got["h"], got["q_plus_2kv"], got["ffn"]), abs=0.051)
    loss = kernels.LOSS_BYTES
    assert loss == pytest.approx(counted["loss_per_token_vocab"], abs=0.051)


def test_float8_casts_are_memory_bound_bytes_of_every_linear():
    """torchao's dynamic scaling per token: 5·K forward, 7·(K + N) in all, over the 7 linears."""
    w = _work()
    h, q, kv, F = 4096, 4096, 1024, 14336
    ins, outs = 5 * h + q + F, q + 2 * kv + 2 * h + 2 * F
    assert w.float8_bytes == pytest.approx((5 * ins, 7 * (ins + outs)))
    plain = compute_seconds(w, H100, "bfloat16", 16384, 32, 0, False, 1, False, "none", False)
    f8 = compute_seconds(w, H100, "bfloat16", 16384, 32, 0, False, 1, False, "none", True)
    matmul = 16384 * 32 * w.layer_matmul
    gain = matmul / (H100.peak("bfloat16") * H100.efficiency) - matmul / (
        H100.peak("float8") * H100.float8_efficiency)  # fmt: skip
    casts = 16384 * 32 * w.float8_bytes[1] / H100.memory_bytes_per_s()
    assert plain - f8 == pytest.approx(gain - casts)
