"""Qwen2 (Nanotron's Qwen2Config): q/k/v bias, NoPE layers, sliding window, document masking
and z-loss, at every layout equal to one process; a packed sequence equal to its documents.

The tests of this subject that need a process group are in `tests/ranks/test_qwen2_ranks.py`."""

from __future__ import annotations

import copy

import torch
from parity import TINY, max_rel_diff

from mesh3d.config.other_families import Qwen2Config
from mesh3d.data.documents import document_positions, mask_document_starts
from mesh3d.models.qwen2 import Qwen2, nope_layer
from mesh3d.train.loss import token_loss_sum

VOCAB, EOS = 16, 3  # a small vocabulary: random tokens hold many EOS, so many documents
QWEN = copy.deepcopy(TINY)
_mc = QWEN["model"]["model_config"]
_mc.pop("is_llama_config")
_mc.update(is_qwen2_config=True, attention_bias=True, no_rope_layer=2, sliding_window_size=6,
           _use_doc_masking=True, num_hidden_layers=4, vocab_size=VOCAB, eos_token_id=EOS,
           z_loss_enabled=True, z_loss_coefficient=1e-3)  # fmt: skip
QWEN["mesh3d"]["dummy_data"] = "random"
STEPS = "tokens.train_steps=3"


def test_layers_follow_nanotron():
    mc = Qwen2Config(
        num_hidden_layers=8, no_rope_layer=4, sliding_window_size=5, attention_bias=True
    )
    assert [i for i in range(8) if nope_layer(mc, i)] == [3, 7]  # SmolLM3's: every 4th, 1-based
    with torch.device("meta"):
        model = Qwen2(mc, vocab_size=32)
    attn = [layer.self_attn for layer in model.layers.values()]
    assert [a.rotary is None for a in attn] == [i in (3, 7) for i in range(8)]
    assert [a.window for a in attn] == [None if i in (3, 7) else 5 for i in range(8)]
    assert attn[0].q_proj.bias is not None and attn[0].o_proj.bias is None


def test_packed_documents_equal_each_document_alone():
    """Three documents packed in one row, with positions restarting at each: each document's
    per-token losses equal the same document run alone (window and NoPE layers included)."""
    torch.manual_seed(0)
    mc = Qwen2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=4, vocab_size=VOCAB, eos_token_id=EOS,
                     attention_bias=True, no_rope_layer=2, sliding_window_size=4)  # fmt: skip
    model = Qwen2(mc, attention="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    docs = [torch.tensor([5, 7, 9, 11, 6, EOS]), torch.tensor([8, 4, 12, EOS]),
            torch.tensor([13, 1, 2, 5, 9, 10, 14])]  # fmt: skip
    packed = torch.cat(docs)[None]  # (1, 17)
    positions = document_positions(packed, EOS)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]]
    with torch.no_grad():
        together = model(packed, positions=positions)[0]  # (17, V)
        alone = torch.cat([model(d[None])[0] for d in docs])
    assert float((together - alone).abs().max()) <= 1e-5 * float(alone.abs().max())
    labels = mask_document_starts(torch.roll(packed, -1, 1), packed, EOS)
    assert labels[0, 5] == labels[0, 9] == -100  # the next document's first token is not a target


def _reference_flash(q, k, v, *, causal, window_size, cu_seqlens=None):
    """flash-attn's documented semantics, written out with explicit loops: per segment of
    `cu_seqlens` (or per row), query i sees keys j <= i with i - j <= window_size[0] (when >= 0),
    GQA by query head h -> kv head h // (Hq / Hkv). q, k, v: [T, H, dh] per segment."""
    assert causal and window_size[1] in (0, -1)

    def attend(q, k, v):  # [T, H, dh]
        t, hq, dh = q.shape
        k, v = (x.repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
        out = torch.empty_like(q)
        for i in range(t):
            lo = max(0, i - window_size[0]) if window_size[0] >= 0 else 0
            scores = torch.einsum("hd,jhd->hj", q[i], k[lo : i + 1]) / dh**0.5
            out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[lo : i + 1])
        return out

    if cu_seqlens is None:  # [B, S, H, dh]
        return torch.stack([attend(*row) for row in zip(q, k, v)])
    bounds = cu_seqlens.tolist()
    return torch.cat([attend(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])])


def test_flash_path_equals_sdpa_masks(monkeypatch):
    """The flash-attn path (CUDA, half precision) passes the window as `window_size` and the
    documents as variable-length segments. With a reference of flash-attn's documented kernel
    semantics in place of flash-attn (absent here), its logits equal the SDPA path's, whose
    masks `test_packed_documents_equal_each_document_alone` checks: rows of several documents,
    a row starting mid-document, window, NoPE and GQA."""
    from mesh3d.models import llama as llama_mod

    torch.manual_seed(0)
    mc = Qwen2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=4, vocab_size=VOCAB, eos_token_id=EOS,
                     attention_bias=True, no_rope_layer=2, sliding_window_size=4)  # fmt: skip
    model = Qwen2(mc, attention="sdpa")
    ids = torch.randint(0, VOCAB, (3, 20))
    positions = document_positions(ids, EOS)
    positions[2] += 3  # this row starts inside a document (its first tokens are one segment)
    offsets, longest = llama_mod.document_segments(positions.clone())
    starts = [r * 20 + c for r in range(3) for c in range(20) if c == 0 or positions[r, c] == 0]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [*starts, 60]
    assert longest == max(b - a for a, b in zip(offsets.tolist(), offsets.tolist()[1:]))
    again = positions.clone()
    assert llama_mod.document_segments(again) is llama_mod.document_segments(again)  # per forward
    again[0, 1] = 0  # modified in place: computed anew
    assert llama_mod.document_segments(again)[0].tolist() == [0, 1, *starts[1:], 60]
    with torch.no_grad():
        sdpa = [model(ids, positions=positions), model(ids)]
        monkeypatch.setattr(llama_mod.Attention, "_use_flash", lambda self, q: True)
        monkeypatch.setattr(llama_mod, "flash_attn_func", _reference_flash)
        monkeypatch.setattr(
            llama_mod, "flash_attn_varlen_func",
            lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw: _reference_flash(q, k, v, cu_seqlens=cu_q, **kw),
        )  # fmt: skip
        flash = [model(ids, positions=positions), model(ids)]
    for a, b in zip(flash, sdpa):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert float((sdpa[0] - sdpa[1]).abs().max()) > 1e-3  # the documents do change the logits


def test_z_loss_is_nanotrons():
    logits = torch.randn(2, 3, 8)
    labels = torch.randint(0, 8, (2, 3))
    labels[0, 1] = -100
    plain = token_loss_sum(logits, labels, 8)
    z = token_loss_sum(logits, labels, 8, z_loss=0.01)
    lse_minus_max = torch.logsumexp(logits, -1) - logits.amax(-1)
    want = 0.01 * (lse_minus_max.square() * (labels != -100)).sum()
    assert torch.allclose(z - plain, want, rtol=1e-5)


# k_proj.bias of a NoPE layer gets no gradient in exact arithmetic (it adds q·b to every score
# of a query, which the softmax ignores): it stays at rounding noise (~1e-8) around its zero
# init, which a relative difference would divide by itself. Those are compared absolutely.
NOISE = {f"layers.{i}.self_attn.k_proj.bias" for i in (1, 3)}


def _diff(run: dict, ref: dict) -> float:
    for name in NOISE:
        assert float((run["weights"][name] - ref["weights"][name]).abs().max()) <= 1e-6, name
    keep = lambda r: {**r, "weights": {k: v for k, v in r["weights"].items() if k not in NOISE}}  # noqa: E731
    return max_rel_diff(keep(run), keep(ref), vocab=VOCAB)
