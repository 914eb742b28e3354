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

A batch of prompts of different lengths is left-padded (`left_pad`): row b starts with
`pads[b]` padding tokens, which no real query sees (a padding query sees itself only, so that
nothing is NaN), and its real tokens have positions 0, 1, ... from its first real one. Causality
and the window are the same in cache indices as in positions, since a row's shift is constant.
Under tensor parallelism each rank's cache holds its own heads; under pipeline parallelism each
rank's holds its own stages' layers (`generation/parallel.py`).
"""

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
        if self.pads is not None:  # (B, 1, S, end): a row's padding keys hidden, but from itself
            real = kpos[None] >= self.pads.to(q.device)[:, None, None]  # (B, 1, end)
            allowed = (allowed[None] & real) | (kpos == qpos)[None]
            allowed = allowed[:, None]
        q, keys, values = (t.transpose(1, 2) for t in (q, keys, values))  # (B, H, S, dh)
        gqa = q.shape[1] != keys.shape[1]
        if s == 1 and window is None and self.pads is None:  # one token sees all: no mask
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                                 enable_gqa=gqa)  # fmt: skip
        return out.transpose(1, 2)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """(ids [B, L], pads [B]): the prompts left-padded with `pad` to the longest, L tokens, and
    how many padding tokens each row starts with."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts])
    return ids, torch.tensor([longest - len(p) for p in prompts])


def pad_positions(pads: Tensor, start: int, end: int) -> Tensor:
    """[B, end - start] positions of cache indices start..end-1 of left-padded rows: each row's
    real tokens count from 0, its padding is at 0."""
    at = torch.arange(start, end, device=pads.device)[None] - pads[:, None]
    return at.clamp(min=0)


class KVCache:
    """Context manager: a `LayerCache` on every attention module of `model` (a module or a
    list of them, e.g. a rank's pipeline stages) while inside; `pads` [B]: left padding."""

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
