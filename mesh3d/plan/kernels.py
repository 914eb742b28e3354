"""What one rank computes in a step, priced by kernel class (docs/plan-search.md, "compute").

Three classes, each at its own rate on the device (`Hardware`):
- matmuls (the linear layers and the lm_head): their FLOPs at `efficiency` x the dtype's peak
  (the decoder's linears at `float8_efficiency` x the float8 peak under `mesh3d.float8`; the
  lm_head stays in bf16);
- attention: the FLOPs a causal flash kernel executes, at `attention_efficiency` x the peak:
  forward QK^T and PV over the unmasked half of the S x S scores (2·q·S per token, half the
  4·q·S the model FLOPs count), backward 2.5x that (it recomputes QK^T: five S x S matmuls to
  the forward's two), the convention FlashAttention's own TFLOP/s figures use;
- everything else (norms, RoPE, SiLU x up, residual adds, casts, copies, the loss's softmax):
  memory-bound, its bytes at `memory_gbps` x `memory_efficiency`. The bytes are counted on
  mesh3d's own Llama layer and loss (benchmarks/kernel_bytes.py,
  benchmarks/results/kernel_bytes.json): eager, and under `mesh3d.compile` (inductor's kernels
  for the compiled blocks: the norms too without tp).
  Per token, forward and forward + backward, as a·h + b·(q + 2·kv) + c·F in bf16; other
  compute dtypes scale them by their size.
Under `mesh3d.float8` (torchao's dynamic tensorwise scaling) each linear also casts, per token:
forward, its input x (K wide): an amax pass (read 2K bytes) and the cast (read 2K, write K);
backward, the output gradient (N wide) the same (5N) and both float8 operands re-laid out for
the weight-gradient matmul (read and write K, and N): 7·(K + N) bytes, memory-bound; a
recomputed forward reruns the 5·K. The weights' own casts (per microbatch, not per token) are
left out: under 2 % of these at the published runs' batches.
Recompute reruns a layer's forward: matmuls, attention and its memory-bound kernels under
`full`; only the memory-bound kernels under `selective` (it keeps matmul and attention outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.plan.hardware import Hardware

# bytes per token of one bf16 decoder layer outside matmuls and attention, as coefficients of
# (h, q + 2 kv, F): benchmarks/results/kernel_bytes.json ("layer"), torch 2.13
LAYER_BYTES = {
    "eager": {"fwd": (112.1, 31.2, 9.4), "all": (361.3, 58.0, 27.4)},
    "compiled": {"fwd": (27.1, 6.9, 6.0), "all": (81.2, 13.2, 16.2)},
    "compiled_tp": {"fwd": (91.6, 6.6, 6.1), "all": (318.3, 12.5, 16.4)},
}
LOSS_BYTES = 44.0  # per token per vocabulary entry, forward + backward ("loss_per_token_vocab")
FLOAT8_CAST = (5.0, 7.0)  # bytes per input width K (forward) and per K + N (all) of a linear


@dataclass(frozen=True)
class Work:
    """Per token of a step, the whole model's (before any split)."""

    layer_matmul: float  # FLOPs of one decoder layer's matmuls, forward + backward
    head_matmul: float  # FLOPs of the lm_head, forward + backward
    attention_fwd: float  # FLOPs a causal attention kernel executes in one layer's forward
    bytes_h: tuple[float, float]  # (forward, forward + backward) bytes of the residual-stream
    # kernels of one layer: split over tp only under sequence parallelism
    bytes_tp: tuple[float, float]  # the same of the head- and F-wide kernels: split over tp
    loss_bytes: float  # bytes of the loss (vocabulary-parallel: split over tp)
    float8_bytes: tuple[float, float] = (0.0, 0.0)  # (forward, all) of one layer's float8 casts


def work_of(spec, shape, seq: int, compute_bytes: int, kind: str = "eager") -> Work:
    """`spec.step_flops` of one sequence cut into the classes above; `kind`: eager, compiled
    (`mesh3d.compile`, tp 1) or compiled_tp (`mesh3d.compile` under tp: the norms stay eager)."""
    L, h, V = shape.num_layers, shape.hidden_size, shape.padded_vocab
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token = spec.step_flops(shape, seq, 1) / seq
    counted = 3 * 4 * q * seq  # attention as the model FLOPs count it: the full S x S, x3
    head = 3 * 2 * h * V
    scale = compute_bytes / 2  # the counts are of bf16 tensors
    a = LAYER_BYTES[kind]
    ins = 5 * h + q + shape.intermediate_size  # q, k, v, gate, up read h; o reads q; down F
    outs = q + 2 * kv + 2 * h + 2 * shape.intermediate_size
    return Work(
        layer_matmul=(per_token - head) / L - counted, head_matmul=head,
        attention_fwd=2 * q * seq,
        bytes_h=(a["fwd"][0] * h * scale, a["all"][0] * h * scale),
        bytes_tp=tuple((c[1] * (q + 2 * kv) + c[2] * shape.intermediate_size) * scale
                       for c in (a["fwd"], a["all"])),
        loss_bytes=LOSS_BYTES * V * scale,
        float8_bytes=(FLOAT8_CAST[0] * ins, FLOAT8_CAST[1] * (ins + outs)),
    )  # fmt: skip


def linear_flops(hw: Hardware, dtype: str, float8: bool = False) -> float:
    """FLOP/s of the decoder's linears: float8 under `mesh3d.float8` where the part has it."""
    if float8 and "float8" in hw.peak_tflops:
        return hw.peak("float8") * hw.float8_efficiency
    return hw.peak(dtype) * hw.efficiency


def compute_seconds(
    w: Work, hw: Hardware, dtype: str, tokens: float, layers: int, recomputed: int,
    head: bool, tp: int, sp: bool, mode: str, float8: bool = False,
) -> float:  # fmt: skip
    """Seconds one rank computes in a step: `tokens` its tokens (the step's over dp x cp),
    `layers` its decoder layers, `recomputed` how many of them rerun their forward (`mode`:
    full or selective), `float8`: the decoder's linears in float8 (`mesh3d.float8`)."""
    rerun = recomputed if mode == "full" else 0  # layers whose matmuls and attention rerun
    peak = hw.peak(dtype)
    fp8 = float8 and "float8" in hw.peak_tflops
    linear = linear_flops(hw, dtype, float8)
    matmul = tokens * (layers + rerun / 3) * w.layer_matmul / tp / linear
    matmul += tokens * head * w.head_matmul / tp / (peak * hw.efficiency)
    attention = tokens * (3.5 * layers + rerun) * w.attention_fwd / tp
    h_fwd, h_all = (b / (tp if sp else 1) for b in w.bytes_h)
    t_fwd, t_all = (b / tp for b in w.bytes_tp)
    moved = tokens * (layers * (h_all + t_all) + recomputed * (h_fwd + t_fwd))
    moved += tokens * head * w.loss_bytes / tp
    if fp8:
        moved += tokens * (layers * w.float8_bytes[1] + recomputed * w.float8_bytes[0]) / tp
    return matmul + attention / (peak * hw.attention_efficiency) + moved / hw.memory_bytes_per_s()
