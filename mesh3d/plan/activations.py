"""Bytes one pipeline stage saves for backward, and holds as output, per microbatch."""

from __future__ import annotations

from collections.abc import Sequence

from mesh3d.models.kernels import grouped_gemm_ok
from mesh3d.plan.sizes import _Sizes


def stage_activation_bytes(
    cfg, layers: int | Sequence[int], embedding: bool, head: bool
) -> tuple[int, int]:
    """(bytes saved for backward, bytes of the held output) of one stage and microbatch.

    `layers`: the stage's decoder layer indices (an int n: layers 0..n-1), which tells the
    mixture-of-experts layers (`moe_saved_bytes`) from the dense ones.

    T = b·s/cp tokens of a rank (its context-parallel share of the b samples), T' = T/tp under
    sequence parallelism else T, e_p / e_c the bytes of the param / compute dtype, h, F, nq
    the hidden, ffn and head sizes, dh = h/nq. A decoder layer:

        2·T'·(h·(4 + e_p) + 4)    its two RMSNorms: fp32 input, normalized input, 1/rms
      + k·T·h·e_c                 q/k/v and gate/up inputs (gathered under SP): k = 2, or 5
                                  under autocast, which saves one cast copy per linear
      + 2·T·(h/tp)·e_c            q and the attention output (nq heads); under cp also the
                                  o_proj input, the two chunks' outputs concatenated: 3·T·...
      + 2·b·s·(nkv·dh/tp)·e_c     k and v (nkv heads: SDPA's enable_gqa keeps them unrepeated),
                                  the whole sequence's: cp gathers them from every rank
      + 4·b·(nq/tp)·s/cp          logsumexp (fp32)
      + 16·p·(s/cp)·dh            RoPE cos/sin (fp32) of q and k; p = b when positions are
                                  given (document masking, cp), else 1
      + 4·T·(F/tp)·e_c            gate output, its activation, up output, their product

    (an MoE layer replaces the MLP's input and the last line with `moe_saved_bytes`), or, with
    `recompute_layer`, its input T'·h·e_p. The first stage adds the ids 8·T (9·T under tp: also
    `LocalEmbedding`'s mask of the ids outside the rank's rows); the last
    adds its norm T'·(h·(4 + e_p) + 4), the lm_head input T·h·e_c, the fp32 log-softmax
    4·T·V' (V' = the real vocab at tp 1, else the padded V/tp) and the labels 8·T + 4 (8·T
    under tp without z-loss: `loss_saved_bytes`). Held until backward: the logits T·(V/tp)·e_c
    on the last stage, else the output T'·h·e_p.
    Measured exact on CPU (SDPA) in fp32, bf16 and bf16 autocast. Not counted: attention
    masks (document masking's boolean mask; under cp, SDPA on CPU saves the causal mask of
    each chunk but the first as a [s/2cp, keys] tensor in the compute dtype; CUDA's SDPA takes
    it unmaterialized in its flash and memory-efficient kernels).
    """
    z = _Sizes.of(cfg)
    ids = range(layers) if isinstance(layers, int) else layers
    norm = z.local_tokens * (z.h * (4 + z.e_p) + 4)
    ids_bytes = (8 + (z.tp > 1)) * z.tokens  # the ids, and under tp the mask of the others' rows
    saved = sum(_layer_bytes(z, i in z.moe_layers, i) for i in ids) + ids_bytes * embedding
    if head:
        saved += norm + z.tokens * z.h * z.e_c + loss_saved_bytes(cfg)
    held = z.tokens * (z.padded // z.tp) * z.e_c if head else z.local_tokens * z.h * z.e_p
    return saved, held


def _layer_bytes(z: _Sizes, moe: bool, index: int = 0) -> int:
    """Decoder layer `index`'s saved bytes (`stage_activation_bytes`'s table; recomputed
    layers: `mesh3d.recompute`, every `recompute_every`-th)."""
    if z.recomputed(index):
        if z.recompute_mode == "full":
            return z.local_tokens * z.h * z.e_p
        if not moe:  # selective: the input, and what its matmuls and attention return
            return z.local_tokens * z.h * z.e_p + selective_kept_bytes(z)
    norm = z.local_tokens * (z.h * (4 + z.e_p) + 4)
    layer = 2 * norm + (3 if z.autocast else 1) * z.tokens * z.h * z.e_c  # q/k/v input
    kv = z.kv_heads * (z.h // z.heads)
    q_out = 2 + (z.cp > 1)  # q, attention output (and under cp its concatenation)
    layer += q_out * z.tokens * (z.h // z.tp) * z.e_c + 2 * z.b * z.s * (kv // z.tp) * z.e_c
    rope = 16 * (z.b if z.positions else 1) * (z.s // z.cp) * (z.h // z.heads)
    layer += 4 * z.b * (z.heads // z.tp) * (z.s // z.cp) + rope
    if moe:
        return layer + moe_saved_bytes(z)
    mlp_in = (2 if z.autocast else 1) * z.tokens * z.h * z.e_c  # gate/up input(s)
    return layer + mlp_in + 4 * z.tokens * (z.ffn // z.tp) * z.e_c


def selective_kept_bytes(z: _Sizes) -> int:
    """What `mesh3d.recompute: selective` keeps of a dense decoder layer besides its input:
    the outputs of its matmuls and of attention (`parallelize._KEPT_OPS`); the rest (norms,
    RoPE, the activation, residual adds, TP collectives) is recomputed in backward.

        T·(h + 2·nkv·dh)/tp·e_c     q, k, v projections
      + T·(h/tp)·e_c + 4·b·(nq/tp)·s/cp   attention output and its logsumexp (fp32)
      + T·h·e_c                   o_proj output (before the tp sum)
      + 2·T·(F/tp)·e_c + T·h·e_c  gate and up projections, down_proj output

    An MoE layer under selective recompute is counted as if not recomputed (an upper bound)."""
    t, dh = z.tokens, z.h // z.heads
    qkv = t * (z.h + 2 * z.kv_heads * dh) // z.tp * z.e_c
    attention = t * (z.h // z.tp) * z.e_c + 4 * z.b * (z.heads // z.tp) * (z.s // z.cp)
    return qkv + attention + t * z.h * z.e_c + 2 * t * (z.ffn // z.tp) * z.e_c + t * z.h * z.e_c


def moe_saved_bytes(z: _Sizes) -> int:
    """What one MoE block (`models/moe.py`) saves for backward per microbatch.

    T = the tokens the block runs on: b·s/cp, over tp the rank's sequence share under sequence
    parallelism (each tp rank runs its T/tp tokens) and every token under ALL_REDUCE (each tp
    rank runs them all, with replicated weights); E experts, top k, F / G the expert / shared
    expert intermediate sizes; the other letters as in `stage_activation_bytes`. Every token
    reaches exactly k distinct experts, so the rows the experts run sum to k·T whatever the
    routing, and only the split of those rows among experts depends on it; every term below is
    linear in the rows:

        4·T·h                     the router's input: x.float() (x itself in fp32), kept in
                                  fp32 under autocast too (the router runs outside it)
      + 4·T·E + 8·T·k + 4·b·E     router probabilities (the fp32 softmax output), top-k
                                  indices (int64), the aux loss's per-sequence expert shares
      + the routed rows: `moe_routed_bytes`
      + T·(4·G·e_c + h·e_c + e_c) the shared expert: gate/up outputs, activation, product,
                                  its output and the sigmoid gate
      + its input: T·h·e_c when it is not the router's input (bf16), 3·T·h·e_c casts under
        autocast (gate, gate_proj, up_proj)
      + 4·E·h                     bf16 params without autocast: the router weight's fp32 copy
      + (E/ep)·3·h·F·e_c          under autocast: the cast of each (local) expert's weight
                                  slices, per expert that got a token (a bound: every expert)

    Measured exact in fp32, bf16 and bf16 autocast (tests/ranks/test_plan_moe_ranks.py). The autocast line
    assumes every expert got a token (true unless an expert is idle for a whole microbatch).
    """
    t, h, e, k, f, g = z.local_tokens, z.h, z.experts, z.top_k, z.moe_ffn, z.shared_ffn
    fp32 = z.e_p == 4 and not z.autocast
    out = 4 * t * h + 4 * t * e + 8 * t * k + 4 * z.b * e + moe_routed_bytes(z)
    if g:
        out += t * (4 * g * z.e_c + h * z.e_c + z.e_c)
        out += 3 * t * h * z.e_c if z.autocast else 0 if fp32 else t * h * z.e_c
    if z.e_p != 4 and not z.autocast:
        out += 4 * e * h
    if z.autocast:
        out += e // z.ep * 3 * h * f * z.e_c
    return out


def moe_routed_bytes(z: _Sizes, received: int | None = None) -> int:
    """What one MoE block saves for its k·T routed rows (T as in `moe_saved_bytes`).

    Without expert parallelism, per routed row:

        k·T·(16 + 4·F·e_c + h·(2·e_c + e_p) + e_p)
            the sort order and each row's token (int64), the gathered input,
            gate|up output, the activation, the product, the expert output, its router weight
            (in x's dtype) and the weighted output index_add keeps

    Under expert parallelism (`parallel/experts.py`) a rank sends exactly k·T rows and runs
    its local experts on the R rows it receives, which depend on the routing:

        k·T·(16 + 2·h·e_p + e_p)  the send side: the sort order and each row's token (int64),
                                  the results sent back, their router weights and the
                                  weighted results index_add keeps (x's dtype)
      + R·(8 + 4·F·e_c + h·(e_c + e_p))
                                  the receive side: each row's index in its expert's batch
                                  (int64), the expert's input (its cast under autocast),
                                  gate|up output, activation, product, and the expert output
                                  index_copy keeps (in x's dtype)

    With the all-gather dispatcher a rank runs its local experts on the R slots of the
    group's ep·T tokens routed to them:

        8·k·ep·T                  the order of every gathered slot (int64), which the slice of
                                  this rank's slots (indexing the weights) keeps alive
      + R·(8 + 4·F·e_c + h·(2·e_c + e_p) + e_p)
                                  each slot's token (int64), the expert's input (its cast
                                  under autocast), gate|up output, activation, product, the
                                  expert output (compute dtype), the weighted one (x's
                                  dtype), its router weight

    Plus 4·E/ep: the int32 expert offsets the two grouped GEMMs keep, when the experts run as
    grouped GEMMs (`grouped_gemm_ok`, judged for the CPU; the loop over experts keeps none).

    `received`: R; default k·T, the expectation under balanced routing (every rank receives
    on average what it sends). tests/ranks/test_plan_moe_ranks.py checks real ep2 runs with their recorded R.
    """
    t, h, k, f = z.local_tokens, z.h, z.top_k, z.moe_ffn
    rows = k * t
    offsets = 4 * z.experts // z.ep if grouped_gemm_ok(h, f, z.e_c) else 0
    if z.ep == 1:
        return rows * (16 + 4 * f * z.e_c + h * (2 * z.e_c + z.e_p) + z.e_p) + offsets
    received = rows if received is None else received
    if z.dispatcher == "allgather":
        return (
            8 * rows * z.ep
            + received * (8 + 4 * f * z.e_c + h * (2 * z.e_c + z.e_p) + z.e_p)
            + offsets
        )
    sent_side = rows * (16 + 2 * h * z.e_p + z.e_p)
    return sent_side + received * (8 + 4 * f * z.e_c + h * (z.e_c + z.e_p)) + offsets


def loss_saved_bytes(cfg) -> int:
    """The part of the last stage's saved bytes that the loss saves, per microbatch: the fp32
    log-softmax 4·T·V' and the labels 8·T + 4 (int64 targets, fp32 total weight); under tp
    without z-loss the softmax of the rank's columns 4·T·V' and the labels 8·T
    (`train/vocab_parallel.py::_VocabParallelCrossEntropy`).

    A split backward frees them at I, not W: torch's `stage_backward_input` detaches the loss
    once the input gradient is computed, which drops the graph nodes past the lm_head matmul,
    as no weight gradient needs them.
    """
    z = _Sizes.of(cfg)
    loss_vocab = z.vocab if z.tp == 1 else z.padded // z.tp
    mc = cfg.model.model_config
    z_loss = getattr(mc, "z_loss_enabled", False) and mc.z_loss_coefficient
    plain = z.tp > 1 and not z_loss  # train/loss.py's vocab-parallel one: no fp32 total weight
    return 4 * z.tokens * loss_vocab + 8 * z.tokens + (0 if plain else 4)
