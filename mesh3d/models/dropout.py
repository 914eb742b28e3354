"""Dropout whose mask is a function of what each value is, not of a random stream.

The promise of layout invariance (the same training at any dp/tp/pp/cp) rules out dropout
drawn from each rank's generator: a rank's stream depends on how many values it held before.
Here every random bit is a hash of the value's identity:

    token key  = hash(seed, step, the sample's index in the step's global batch, its position)
    keep(value) = hash(token key, site, feature) >= p · 2^32

`token_keys` makes the token keys (training passes them to a model with dropout as
`token_keys` [B, S], one per token a rank holds, `train/step.py`); `KeyedDropout` drops a
[B, S, F] activation at one site (a layer's residual branch, the embedding), and
`attention_keep` the attention probabilities [B, H, Sq, Sk] (site, head, key position). A
sequence shard (tensor-parallel sequence parallelism) or a head shard learns its offset from
`tp_rank` (the TP plan's `RankAware` style sets it), a cp shard holds its tokens' keys already,
and recomputation in backward hashes the same keys: the mask is the one-process mask at any
layout. The hash is lowbias32 (C. Wellons) on int64 tensors holding 32-bit values; its
products are split in 16-bit halves so that no int64 overflows.

Without `token_keys` (a model called in training mode outside mesh3d's loop), each row gets a
key from torch's generator: fresh masks each call, as `nn.Dropout`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

MASK32 = 0xFFFFFFFF
POSITION_SALT = 0x2545F491  # keeps hash(i) of positions, features, heads and keys apart
FEATURE_SALT = 0x68E31DA4
HEAD_SALT = 0x1B56C4E9
KEY_SALT = 0x7F4A7C15


def _mul32(x, c: int):
    """(x · c) mod 2^32 for x in [0, 2^32): each partial product stays below 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x):
    """A 32-bit hash of x in [0, 2^32): an int, or an int64 tensor elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _indices(n: int, salt: int, device) -> Tensor:
    """hash(i ^ salt) for i < n: the column keys of features, heads or key positions."""
    return mix32(torch.arange(n, dtype=torch.int64, device=device) ^ salt)


def token_keys(seed: int, step: int, samples: Tensor, positions: Tensor) -> Tensor:
    """Each token's key [B, S] (int64 in [0, 2^32)): `samples` [B] are the rows' indices in the
    step's global batch, `positions` [S] the tokens' positions in their sample."""
    base = mix32(mix32(seed & MASK32) ^ (step & MASK32))
    rows = mix32(samples.to(torch.int64) ^ base)  # (B,)
    return mix32(rows[:, None] ^ mix32(positions.to(torch.int64) ^ POSITION_SALT)[None])


def random_keys(rows: int, tokens: int, device) -> Tensor:
    """Token keys for a call without them: one random key per row from torch's generator."""
    row = torch.randint(0, 2**32, (rows,), dtype=torch.int64, device=device)
    return token_keys(0, 0, row, torch.arange(tokens, device=device))


def _keep(hashes: Tensor, p: float) -> Tensor:
    return hashes >= round(p * 2**32)  # P(keep) = 1 - p, to 2^-32


def site_salt(site: int) -> int:
    """The salt of dropout site `site` (each site of a model has its own number)."""
    return mix32((site * 0x9E3779B9) & MASK32)


def attention_keep(keys: Tensor, site: int, head_offset: int, heads: int, n_keys: int,
                   p: float) -> Tensor:  # fmt: skip
    """The keep mask [B, heads, Sq, n_keys] of attention probabilities: query token keys `keys`
    [B, Sq], global heads head_offset .. head_offset + heads - 1, key positions 0 .. n_keys - 1
    (of the whole sample)."""
    rows = mix32(keys ^ site_salt(site))  # (B, Sq)
    head = _indices(head_offset + heads, HEAD_SALT, keys.device)[head_offset:]  # (H,)
    rows = mix32(rows[:, None, :] ^ head[None, :, None])  # (B, H, Sq)
    cols = _indices(n_keys, KEY_SALT, keys.device)  # (Sk,)
    return _keep(mix32(rows[..., None] ^ cols), p)


class KeyedDropout(nn.Module):
    """Dropout of a [B, S, F] activation with the mask hash(token key, site, feature).

    `forward(x, keys)`: `keys` [B, S_keys] are the token keys of the rank's whole (cp-local)
    sequence; when `x` holds fewer tokens (sequence parallelism: the residual stream split over
    tp), it holds those of tp rank `tp_rank`. Kept values are scaled by 1 / (1 - p).
    """

    def __init__(self, p: float, site: int):
        super().__init__()
        self.p = p
        self.site = site
        self.tp_rank = 0  # set by the TP plan (`tp_family_styles.RankAware`)

    def forward(self, x: Tensor, keys: Tensor | None) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if keys is None:
            keys = random_keys(x.shape[0], x.shape[1], x.device)
        s = x.shape[1]
        if keys.shape[1] != s:  # this tp rank's slice of the sequence
            keys = keys[:, self.tp_rank * s : (self.tp_rank + 1) * s]
        rows = mix32(keys ^ site_salt(self.site))  # (B, S)
        cols = _indices(x.shape[-1], FEATURE_SALT, x.device)  # (F,)
        keep = _keep(mix32(rows[..., None] ^ cols), self.p)
        return torch.where(keep, x * (1.0 / (1.0 - self.p)), 0.0)  # saves the boolean mask

    def attention(self, probs: Tensor, keys: Tensor | None) -> Tensor:
        """Dropout of attention probabilities [B, H, Sq, Sk]: this rank's H heads (those of tp
        rank `tp_rank`), queries with token keys `keys` [B, Sq], keys at positions 0 .. Sk-1."""
        if not self.training or self.p == 0:
            return probs
        b, h, sq, sk = probs.shape
        if keys is None:
            keys = random_keys(b, sq, probs.device)
        keep = attention_keep(keys, self.site, self.tp_rank * h, h, sk, self.p)
        return torch.where(keep, probs * (1.0 / (1.0 - self.p)), 0.0)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"
