"""Bytes one pipeline stage saves for backward, and holds as output, per microbatch."""

from __future__ import annotations

from mesh3d.plan.sizes import _Sizes


def stage_activation_bytes(cfg, layers: int, embedding: bool, head: bool) -> tuple[int, int]:
    """(bytes saved for backward, bytes of the held output) of one stage and microbatch.

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

    or, with `recompute_layer`, its input T'·h·e_p. The first stage adds the ids 8·T; the last
    adds its norm T'·(h·(4 + e_p) + 4), the lm_head input T·h·e_c, the fp32 log-softmax
    4·T·V' (V' = the real vocab at tp 1, else the padded V/tp) and the labels 8·T + 4. Held
    until backward: the logits T·(V/tp)·e_c on the last stage, else the output T'·h·e_p.
    Measured exact on CPU (SDPA) in fp32, bf16 and bf16 autocast. Not counted: attention
    masks (document masking's boolean mask; under cp, SDPA on CPU saves the causal mask of
    each chunk but the first as a [s/2cp, keys] tensor in the compute dtype; CUDA's SDPA takes
    it unmaterialized in its flash and memory-efficient kernels).
    """
    z = _Sizes.of(cfg)
    norm = z.local_tokens * (z.h * (4 + z.e_p) + 4)
    if z.recompute:
        layer = z.local_tokens * z.h * z.e_p
    else:
        layer = 2 * norm + (5 if z.autocast else 2) * z.tokens * z.h * z.e_c
        kv = z.kv_heads * (z.h // z.heads)
        q_out = 2 + (z.cp > 1)  # q, attention output (and under cp its concatenation)
        layer += q_out * z.tokens * (z.h // z.tp) * z.e_c + 2 * z.b * z.s * (kv // z.tp) * z.e_c
        layer += 4 * z.tokens * (z.ffn // z.tp) * z.e_c
        rope = 16 * (z.b if z.positions else 1) * (z.s // z.cp) * (z.h // z.heads)
        layer += 4 * z.b * (z.heads // z.tp) * (z.s // z.cp) + rope
    saved = layers * layer + 8 * z.tokens * embedding
    if head:
        saved += norm + z.tokens * z.h * z.e_c + loss_saved_bytes(cfg)
    held = z.tokens * (z.padded // z.tp) * z.e_c if head else z.local_tokens * z.h * z.e_p
    return saved, held


def loss_saved_bytes(cfg) -> int:
    """The part of the last stage's saved bytes that the loss saves, per microbatch: the fp32
    log-softmax 4·T·V' and the labels 8·T + 4 (int64 targets, fp32 total weight).

    A split backward frees them at I, not W: torch's `stage_backward_input` detaches the loss
    once the input gradient is computed, which drops the graph nodes past the lm_head matmul,
    as no weight gradient needs them.
    """
    z = _Sizes.of(cfg)
    loss_vocab = z.vocab if z.tp == 1 else z.padded // z.tp
    return 4 * z.tokens * loss_vocab + 8 * z.tokens + 4
