"""A KV cache for generation: a new token is one forward of that token alone.

`KVCache` sets a `LayerCache` as `kv` on every attention module (a slot the models leave None);
the model then calls `kv.attend(q, k, v, window)`. A query at position p sees keys at <= p, and
with a sliding window only those > p - window (the training mask). Left-padded rows
(`left_pad`) hide their padding from every real query; a padding query sees itself only, so
nothing is NaN. A row's shift is constant, so causality and the window hold in cache indices."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerCache:
    """One attention layer's keys and values, [B, capacity, nkv, dh], filled up to `length`."""

    def __init__(self, capacity: int, pads: Tensor | None = None):
        self.capacity, self.length, self.pads = capacity, 0, pads
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """Queries q [B, S, nq, dh] against the cached keys and new k, v -> [B, S, nq, dh]."""
        b, s = q.shape[:2]
        if self.k is None:
            self.k, self.v = (t.new_empty((b, self.capacity, *k.shape[2:])) for t in (k, v))
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
        if self.pads is not None:  # (B, 1, S, end): a row's padding keys hidden, but from itself
            real = kpos[None] >= self.pads.to(q.device)[:, None, None]  # (B, 1, end)
            allowed = ((allowed[None] & real) | (kpos == qpos)[None])[:, None]
        q, keys, values = (t.transpose(1, 2) for t in (q, keys, values))  # (B, H, S, dh)
        mask = None if s == 1 and window is None and self.pads is None else allowed  # sees all
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=q.shape[1] != keys.shape[1])  # fmt: skip
        return out.transpose(1, 2)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """(ids [B, L], pads [B]): the prompts left-padded with `pad` to the longest."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts])
    return ids, torch.tensor([longest - len(p) for p in prompts])


def pad_positions(pads: Tensor, start: int, end: int) -> Tensor:
    """[B, end - start] positions of cache indices start..end-1: real tokens from 0, padding 0."""
    return (torch.arange(start, end, device=pads.device)[None] - pads[:, None]).clamp(min=0)


class KVCache:
    """Context manager: a `LayerCache` on every attention module of `model` (or a list)."""

    def __init__(self, model: nn.Module | list[nn.Module], capacity: int,
                 pads: Tensor | None = None):  # fmt: skip
        models = model if isinstance(model, list | tuple) else [model]
        self.layers = [m for part in models for m in part.modules()
                       if hasattr(m, "kv") and hasattr(m, "attend")]  # fmt: skip
        if not self.layers and not isinstance(model, list | tuple):
            raise TypeError(f"{type(model).__name__} has no attention module with a `kv` slot")
        self.capacity, self.pads = capacity, pads

    def __enter__(self) -> KVCache:
        for m in self.layers:
            m.kv = LayerCache(self.capacity, self.pads)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.kv = None
