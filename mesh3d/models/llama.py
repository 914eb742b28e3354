"""Single-device Llama, the model every layout trains (Nanotron's Llama), batch-first [B, S, h].

Module names are Hugging Face's; q/k/v and gate/up are separate (`checkpoint/` fuses on write).
`layers` is a ModuleDict keyed "0", "1", ...: a pipeline stage deletes the layers it does not own
and `forward` skips modules set to None. Shapes come from tensors, not head counts, so tp shards
run the same code. No buffers, so meta-device builds and `to_empty` need only `tie_weights`.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.errors import ConfigError
from mesh3d.models.activations import ACTIVATIONS, HIDDEN_ACTS
from mesh3d.models.dtypes import DTYPES  # noqa: F401  (re-exported for library code)
from mesh3d.torch_private import version_counter
from mesh3d.tp_local import local_of

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:
    flash_attn_func = flash_attn_varlen_func = None

ATTENTION_KINDS = ("auto", "sdpa", "flash")


def activation(name: str):
    """The activation function called `name` (`model.model_config.hidden_act`)."""
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"`model.model_config.hidden_act` {name!r} is not supported; "
            f"use one of {', '.join(HIDDEN_ACTS)}"
        )
    function, kwargs = ACTIVATIONS[name]
    return functools.partial(getattr(F, function), **kwargs) if kwargs else getattr(F, function)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> Tensor:
    """Inverse frequencies theta^(-2j/dh), j < dh/2, in fp32 on CPU; llama3 scaling as in HF."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (dh/2,)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))  # "type": older HF configs
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ConfigError(
            f"`model.model_config.rope_scaling` type {kind!r} is not supported; "
            "use rope_type 'llama3' or set rope_scaling to null"
        )
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, those in between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """Rotary position embedding on [B, S, H, dh] tensors (a plain object: no buffers).

    `interleaved` pairs (2i, 2i+1) as GPT-J, else (i, i + dh/2) as HF
    (docs/nanotron-layout.md#rotary-layouts). Positions are 0..S-1 or `positions` [B, S],
    divided by `interpolation` (Nanotron's `rope_seq_len_interpolation_factor`).
    """

    def __init__(self, inv_freq: Tensor, interleaved: bool, interpolation: float | None = None):
        self.inv_freq, self.interleaved, self.interpolation = inv_freq, interleaved, interpolation
        self._on_device: dict[torch.device, Tensor] = {}  # no host-to-device copy per call

    def _freqs(self, seq_len: int, device: torch.device, positions: Tensor | None) -> Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        if positions is None:
            pos = torch.arange(seq_len, device=device, dtype=torch.float32)[None]  # (1, S)
        else:
            pos = positions.to(device=device, dtype=torch.float32)  # (B, S)
        if self.interpolation:
            pos = pos / self.interpolation
        freqs = pos[..., None] * self._on_device[device]  # (B|1, S, dh/2)
        if self.interleaved:
            return freqs.repeat_interleave(2, dim=-1)  # (B|1, S, dh)
        return torch.cat((freqs, freqs), dim=-1)  # (B|1, S, dh)

    def _rotate(self, x: Tensor) -> Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def __call__(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        freqs = self._freqs(x.shape[1], x.device, positions)[:, :, None, :]  # (B|1, S, 1, dh)
        xf = x.float()
        return (xf * freqs.cos() + self._rotate(xf) * freqs.sin()).to(x.dtype)


def attention_mask(
    positions: Tensor | None, seq_len: int, window: int | None, device
) -> Tensor | None:
    """The causal boolean [B|1, 1, S, S] mask (True: attend), or None when plain causal suffices.

    `positions` [B, S] keeps each query in its document (starting where the position is 0);
    `window` W keeps W keys including itself, as Nanotron's and HF's windows.
    """
    if positions is None and window is None:
        return None
    q = torch.arange(seq_len, device=device)
    mask = q[:, None] >= q[None, :]  # (S, S) causal
    if window is not None:
        mask = mask & (q[:, None] - q[None, :] < window)
    mask = mask[None]  # (1, S, S)
    if positions is not None:
        doc = torch.cumsum((positions == 0).int(), dim=-1).to(device)  # (B, S) document ids
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    return mask[:, None]  # (B|1, 1, S, S)


@torch.compiler.disable  # data-dependent sizes and a cache: always eager
def document_segments(positions: Tensor) -> tuple[Tensor, int]:
    """flash-attn's varlen index of packed rows: (int32 segment offsets plus the total, longest).

    Segments start at each row's start and wherever the position is 0. Example: positions
    [[0, 1, 0, 1, 2], [3, 4, 0, 1, 2]] -> offsets [0, 2, 5, 7, 10], longest 3. The last result
    is reused while the same `positions` tensor is alive and unmodified: one host sync a forward.
    """
    ref, version, cached = _last_segments
    if ref is not None and ref() is positions and version == version_counter(positions):
        return cached
    starts = positions == 0
    starts[:, 0] = True
    index = starts.flatten().nonzero().flatten()
    total = torch.tensor([positions.numel()], device=positions.device)
    offsets = torch.cat([index, total]).to(torch.int32)
    result = offsets, int((offsets[1:] - offsets[:-1]).max())
    _last_segments[:] = [weakref.ref(positions), version_counter(positions), result]
    return result


_last_segments: list = [None, None, None]  # [weakref to positions, its version, result]


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), normalized in fp32 (HF LlamaRMSNorm numerics)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps
        self.grad_placement = None  # set under tp (tp_styles.LocalReplicated), for local_of

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if self.grad_placement is not None:
            w = local_of(w, self.grad_placement)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)


class AttentionCore(nn.Module):
    """Causal attention of projected heads, the part every family's attention shares.

    `attend` picks the kernel: the KV cache's (`kv`) or context parallel's (`cp`), both set from
    outside, else flash-attn in half precision on CUDA when installed, else SDPA.
    `rotary`: RoPE, or None (NoPE).
    """

    def __init__(self, rotary: Rotary | None, attention: str, window: int | None, head_dim: int):
        super().__init__()
        self.head_dim, self.rotary = head_dim, rotary
        self.window, self.attention = window, attention
        self.cp = None  # set when the sequence is split over cp: parallel.context.ContextParallel
        self.kv = None  # set while generating with a KV cache: generation.cache.LayerCache

    def _use_flash(self, q: Tensor) -> bool:
        # flash-attn has no fp32 kernel: fp32 runs (CPU tests, parity checks) take SDPA.
        half = q.dtype in (torch.float16, torch.bfloat16)
        return self.attention != "sdpa" and flash_attn_func is not None and q.is_cuda and half

    def _flash(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None) -> Tensor:
        """flash-attn on [B, S, H, dh] (GQA native); documents through its varlen kernel."""
        window = (self.window - 1, 0) if self.window is not None else (-1, -1)
        if positions is None:
            return flash_attn_func(q, k, v, causal=True, window_size=window)
        b, s = positions.shape
        cu_seqlens, longest = document_segments(positions)
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))  # (B*S, H, dh)
        out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest,
                                     causal=True, window_size=window)  # fmt: skip
        return out.view(b, s, *out.shape[1:])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None) -> Tensor:
        """q [B, S, nq, dh], k and v [B, S, nkv, dh] (RoPE applied) -> [B, S, nq, dh]."""
        if self.kv is not None:  # generation: the new tokens against every cached key
            return self.kv.attend(q, k, v, self.window)
        if self.cp is not None and self.cp.size > 1:
            return self.cp.attend(q, k, v, positions, self.window)  # (B, S/cp, nq, dh)
        if self._use_flash(q):
            return self._flash(q, k, v, positions)
        mask = attention_mask(positions, q.shape[1], self.window, q.device)  # None: plain causal
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, dh)
        gqa = q.shape[1] != k.shape[1]  # GQA inside SDPA: no repeated copies of k and v
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
        )
        return out.transpose(1, 2)


class Attention(AttentionCore):
    """Causal multi-head attention with grouped kv heads, RoPE, no dropout.

    Family options: `bias` on q/k/v (Qwen2), `rope` off (NoPE), `window` (sliding window),
    `qk_norm_eps` (Qwen3: RMSNorm of each q and k head before RoPE), `head_dim`.
    """

    def __init__(self, h: int, n_q: int, n_kv: int, rotary: Rotary, attention: str, *,
                 bias: bool = False, rope: bool = True, window: int | None = None,
                 head_dim: int | None = None, qk_norm_eps: float | None = None):  # fmt: skip
        super().__init__(rotary if rope else None, attention, window, head_dim or h // n_q)
        self.q_proj = nn.Linear(h, n_q * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_q * self.head_dim, h, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, S, nq, dh)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, S, nkv, dh)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (B, S, nkv, dh)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        return self.o_proj(self.attend(q, k, v, positions).reshape(b, s, -1))  # (B, S, h)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, h: int, ffn: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); `options` are `Attention`'s keywords."""

    def __init__(self, cfg, rotary: Rotary, attention: str, **options):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, cfg.num_attention_heads, n_kv, rotary, attention, **options)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size, activation(cfg.hidden_act))

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions=positions)
        return x + self.mlp(self.post_attention_layernorm(x))


def _check(cfg, attention: str) -> None:
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    free_head = getattr(cfg, "head_dim", None)  # Qwen3: any head size
    if (cfg.hidden_size % n_q and not free_head) or n_q % n_kv:
        raise ConfigError(
            f"`model.model_config.hidden_size` ({cfg.hidden_size}) must be a multiple of "
            f"`num_attention_heads` ({n_q}), itself a multiple of `num_key_value_heads` ({n_kv})"
        )
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"`mesh3d.attention` {attention!r} must be one of {ATTENTION_KINDS}")
    if attention == "flash" and flash_attn_func is None:
        raise ImportError(
            "`mesh3d.attention: flash` needs flash-attn: `pip install flash-attn` "
            "(or `pip install mesh3d[flash]`), or set `mesh3d.attention` to sdpa or auto"
        )


class Llama(nn.Module):
    """Llama for causal LM: ids [B, S] -> logits [B, S, V] (V = padded `vocab_size`).

    `cfg` is Nanotron's LlamaConfig; `attention` is "auto", "sdpa" or "flash".

    Example:

        with torch.device("meta"):
            model = mesh3d.Llama(cfg.model.model_config, vocab_size=padded_vocab)
    """

    def __init__(self, cfg, vocab_size: int | None = None, attention: str = "auto"):
        super().__init__()
        _check(cfg, attention)
        h, vocab = cfg.hidden_size, vocab_size or cfg.vocab_size
        head_dim = self.layer_options(cfg, 0).get("head_dim") or h // cfg.num_attention_heads
        inv_freq = rope_inv_freq(
            head_dim, getattr(cfg, "rope_theta", 10000.0), getattr(cfg, "rope_scaling", None)
        )
        interpolation = getattr(cfg, "rope_seq_len_interpolation_factor", None)
        rotary = Rotary(inv_freq, getattr(cfg, "rope_interleaved", False), interpolation)
        self.attention = attention
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, rotary, attention, **self.layer_options(cfg, i))
                                     for i in range(cfg.num_hidden_layers)})  # fmt: skip
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.tie_weights()

    @staticmethod
    def layer_options(cfg, i: int) -> dict:
        """Layer `i`'s `Attention` keywords: none for Llama; other families override this."""
        return {}

    @property
    def tied_parameters(self) -> dict[str, str]:
        """Alias name -> owner name of tied parameters (the alias is the same tensor)."""
        return {"lm_head.weight": "embed_tokens.weight"} if self.tie_word_embeddings else {}

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding's Parameter when tied (and both are present)."""
        if self.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token ids [B, S] (hidden states on a later pipeline stage) -> logits.

        `positions` [B, S]: each token's position in its document; None: 0..S-1.
        """
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, S, h)
        for layer in self.layers.values():
            h = layer(h, positions=positions)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h  # (B, S, V) or (B, S, h)


def num_params(model: nn.Module) -> int:
    """Number of parameters, tied ones counted once (full sizes for sharded DTensors)."""
    return sum(p.numel() for p in model.parameters())
