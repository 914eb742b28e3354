"""A KV cache for generation: each attention layer keeps the keys and values it has computed,
so a new token is one forward of that token alone instead of the whole sequence.

`LayerCache` is set as `kv` on every attention module of the model (`AttentionCore.kv`, a slot
the models leave None) for the length of a `generate` call; the model then calls
`kv.attend(q, k, v, window)` instead of its own attention. Keys and values are written into
buffers allocated once for the prompt plus the new tokens. A query at absolute position p sees
the keys at positions <= p, and with a sliding window `window` only those > p - window (the
models' training mask, `models/llama.py::attention_mask`). RoPE needs each token's absolute
position: `generate` hands the model `positions` (prompt: 0..S-1, then S, S+1, ...); NoPE layers
have no rotary and ignore them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerCache:
    """One attention layer's keys and values, [B, capacity, nkv, dh], filled up to `length`."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """The new queries q [B, S, nq, dh] (RoPE applied) against every cached key and the new
        ones k, v [B, S, nkv, dh] -> [B, S, nq, dh]."""
        b, s = q.shape[:2]
        if self.k is None:
            shape = (b, self.capacity, *k.shape[2:])
            self.k = k.new_empty(shape)
            self.v = v.new_empty(shape)
        start, end = self.length, self.length + s
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions is full")
        self.k[:, start:end], self.v[:, start:end] = k, v
        self.length = end
        keys, values = self.k[:, :end], self.v[:, :end]
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        q, keys, values = (t.transpose(1, 2) for t in (q, keys, values))  # (B, H, S, dh)
        gqa = q.shape[1] != keys.shape[1]
        if s == 1 and window is None:  # one new token sees everything: no mask
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                                 enable_gqa=gqa)  # fmt: skip
        return out.transpose(1, 2)


class KVCache:
    """Context manager: a `LayerCache` on every attention module of `model` while inside."""

    def __init__(self, model: nn.Module, capacity: int):
        self.layers = [m for m in model.modules() if hasattr(m, "kv") and hasattr(m, "attend")]
        if not self.layers:
            raise TypeError(f"{type(model).__name__} has no attention module with a `kv` slot")
        self.capacity = capacity

    def __enter__(self) -> KVCache:
        for m in self.layers:
            m.kv = LayerCache(self.capacity)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.kv = None
