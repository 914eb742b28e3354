"""Single-device Starcoder2 as Nanotron's `Starcoder2Config` defines it (GPT-BigCode blocks with
RoPE, multi-query or grouped-query attention, sliding windows and dropout).

A decoder layer: x + drop(attn(LN(x))), then + drop(mlp(LN(x))), with LayerNorms with a bias,
a GELU MLP `c_proj(act(c_fc(x)))` with biases, and attention whose projections all have biases:
- multi-query (`multi_query`, Nanotron's default when neither is set): `q_proj` and one key /
  value head `kv_proj` ([k; v] rows), which every tensor-parallel rank holds whole;
- grouped-query (`grouped_query` + `num_kv_heads`): one `qkv_proj` in Nanotron's layout, for
  each key/value head its group of query heads, then its key, then its value (so a
  column split over tp hands each rank whole groups).
RoPE (`use_rotary_embeddings`, base `rope_theta`, rotate-half) on positions 0..S-1; every layer
but `global_attn_layers` sees its last `sliding_window_size` keys. Embeddings are always tied
(Nanotron ties them for this family). Dropout (`embd_pdrop` after the embedding, `attn_pdrop`
on the attention probabilities and on the attention branch, `resid_pdrop` on the MLP branch,
as Nanotron) draws its masks from each token's key (`models/dropout.py`): the model takes
`token_keys` [B, S] beside the ids. With attention dropout, training computes the attention
probabilities explicitly ([B, H, S, S] per layer) to drop them; without it, and in eval, the
kernels are Llama's (`AttentionCore`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.errors import ConfigError
from mesh3d.models.dropout import KeyedDropout, random_keys
from mesh3d.models.llama import AttentionCore, Rotary, _check, activation, rope_inv_freq
from mesh3d.tp_local import local_of


def dropout_sites(layer: int) -> tuple[int, int, int]:
    """The dropout site numbers of layer `layer`: its attention branch, MLP branch and attention
    probabilities (site 0 is the embedding)."""
    return 3 * layer + 1, 3 * layer + 2, 3 * layer + 3


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias that reads them as local tensors under tensor
    parallelism (`grad_placement`, as `llama.RMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.grad_placement = None  # set under tensor parallelism (tp_styles.LocalReplicated)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        if self.grad_placement is not None:
            w, b = (local_of(t, self.grad_placement) for t in (w, b))
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class SharedLinear(nn.Linear):
    """A linear every tensor-parallel rank holds whole: multi-query attention's key/value head.
    Under tp its weight and bias are read as local tensors whose gradient is `grad_placement`
    (`Partial()`: each rank's query heads add their share)."""

    grad_placement = None

    def forward(self, x: Tensor) -> Tensor:
        if self.grad_placement is None:
            return super().forward(x)
        w, b = (local_of(t, self.grad_placement) for t in (self.weight, self.bias))
        return F.linear(x, w, b)


class Starcoder2Attention(AttentionCore):
    """Multi-query or grouped-query attention with biases, optional RoPE and window, and
    dropout of the attention probabilities (see the module doc)."""

    def __init__(self, cfg, rotary: Rotary | None, attention: str, layer: int):
        h, n_q = cfg.hidden_size, cfg.num_attention_heads
        window = None if layer in cfg.global_attn_layers else cfg.sliding_window_size
        super().__init__(rotary, attention, window, h // n_q)
        dh = self.head_dim
        self.multi_query = not cfg.grouped_query  # Nanotron's default when neither is set
        if self.multi_query:
            self.q_proj = nn.Linear(h, n_q * dh)
            self.kv_proj = SharedLinear(h, 2 * dh)
        else:
            self.group = n_q // cfg.num_kv_heads  # query heads per key/value head
            self.qkv_proj = nn.Linear(h, cfg.num_kv_heads * (self.group + 2) * dh)
        self.o_proj = nn.Linear(n_q * dh, h)
        self.probs_dropout = KeyedDropout(cfg.attn_pdrop, dropout_sites(layer)[2])

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, nq, dh], k and v [B, S, nkv, dh] (the heads this module holds)."""
        b, s, _ = x.shape
        dh = self.head_dim
        if self.multi_query:
            k, v = self.kv_proj(x).view(b, s, 2, 1, dh).unbind(2)
            return self.q_proj(x).view(b, s, -1, dh), k, v
        qkv = self.qkv_proj(x).view(b, s, -1, self.group + 2, dh)  # (B, S, nkv, group + 2, dh)
        q = qkv[..., : self.group, :].flatten(2, 3)
        return q, qkv[..., self.group, :], qkv[..., self.group + 1, :]

    def forward(self, x: Tensor, positions: Tensor | None = None,
                token_keys: Tensor | None = None) -> Tensor:  # fmt: skip
        b, s, _ = x.shape
        q, k, v = self.project(x)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.training and self.probs_dropout.p > 0:
            out = self._attend_dropped(q, k, v, positions, token_keys)
        else:
            out = self.attend(q, k, v, positions)
        return self.o_proj(out.reshape(b, s, -1))

    def _attend_dropped(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None,
                        token_keys: Tensor | None) -> Tensor:  # fmt: skip
        """Attention with dropped probabilities, written out: softmax(q·kᵀ/√dh + causal mask)
        in fp32, dropout, times v. Under cp, the keys and values of the whole sequence are
        gathered, and `positions` (each query's index in its sample) place the queries."""
        if self.cp is not None and self.cp.size > 1:
            k, v = self.cp.gather(k), self.cp.gather(v)  # (B, S, nkv, dh) in sequence order
        n = k.shape[1]
        rows = positions if positions is not None else torch.arange(q.shape[1], device=q.device)
        rows = rows.reshape(-1, q.shape[1], 1)  # (B|1, Sq, 1)
        cols = torch.arange(n, device=q.device)
        allowed = rows >= cols
        if self.window is not None:
            allowed = allowed & (rows - cols < self.window)
        b, sq, hq, dh = q.shape
        nkv = k.shape[2]
        q = q.transpose(1, 2).reshape(b, nkv, hq // nkv, sq, dh)  # query heads by kv group
        k, v = (t.transpose(1, 2)[:, :, None] for t in (k, v))  # (B, nkv, 1, n, dh)
        scores = torch.matmul(q, k.transpose(-1, -2)).view(b, hq, sq, n) * dh**-0.5
        scores = scores.float().masked_fill(~allowed[:, None], float("-inf"))
        probs = self.probs_dropout.attention(scores.softmax(-1).to(v.dtype), token_keys)
        out = torch.matmul(probs.view(b, nkv, hq // nkv, sq, n), v)  # (B, nkv, group, Sq, dh)
        return out.view(b, hq, sq, dh).transpose(1, 2)  # (B, Sq, nq, dh)


class Starcoder2MLP(nn.Module):
    """c_proj(act(c_fc(x))), both with a bias."""

    def __init__(self, h: int, ffn: int, act):
        super().__init__()
        self.c_fc = nn.Linear(h, ffn)
        self.c_proj = nn.Linear(ffn, h)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2Layer(nn.Module):
    """x + drop(attn(LN(x))), then + drop(mlp(LN(x))) (Nanotron's GPTBlock)."""

    def __init__(self, cfg, rotary: Rotary | None, attention: str, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        attn_site, mlp_site, _ = dropout_sites(layer)
        self.input_layernorm = LayerNorm(h, eps)
        self.self_attn = Starcoder2Attention(cfg, rotary, attention, layer)
        self.attn_dropout = KeyedDropout(cfg.attn_pdrop, attn_site)
        self.post_attention_layernorm = LayerNorm(h, eps)
        ffn = cfg.intermediate_size or 4 * h  # Nanotron's d_ff
        self.mlp = Starcoder2MLP(h, ffn, activation(cfg.activation_function))
        self.mlp_dropout = KeyedDropout(cfg.resid_pdrop, mlp_site)

    def forward(self, x: Tensor, positions: Tensor | None = None,
                token_keys: Tensor | None = None) -> Tensor:  # fmt: skip
        attn = self.self_attn(self.input_layernorm(x), positions=positions, token_keys=token_keys)
        x = x + self.attn_dropout(attn, token_keys)
        return x + self.mlp_dropout(self.mlp(self.post_attention_layernorm(x)), token_keys)


def _check_attention(cfg) -> None:
    if cfg.multi_query and cfg.grouped_query:
        raise ConfigError("`model.model_config.multi_query` and `grouped_query` are both true; "
                          "set one of them")  # fmt: skip
    if cfg.grouped_query and (not cfg.num_kv_heads or cfg.num_attention_heads % cfg.num_kv_heads):
        raise ConfigError(
            f"`model.model_config.num_kv_heads` ({cfg.num_kv_heads}) must divide "
            f"num_attention_heads ({cfg.num_attention_heads}) with grouped_query"
        )


class Starcoder2(nn.Module):
    """Starcoder2 for causal LM: ids [B, S] (and token keys [B, S] when training with dropout)
    -> logits [B, S, V] (V = padded `vocab_size`).

    Example:

        with torch.device("meta"):
            model = Starcoder2(cfg.model.model_config, vocab_size=padded_vocab)
    """

    tie_word_embeddings = True  # Nanotron always ties this family's embeddings

    def __init__(self, cfg, vocab_size: int | None = None, attention: str = "auto"):
        super().__init__()
        _check(cfg, attention)
        _check_attention(cfg)
        h, vocab = cfg.hidden_size, vocab_size or cfg.vocab_size
        rotary = None
        if cfg.use_rotary_embeddings:
            rotary = Rotary(rope_inv_freq(h // cfg.num_attention_heads, cfg.rope_theta), False)
        self.attention = attention
        self.has_dropout = max(cfg.attn_pdrop, cfg.embd_pdrop, cfg.resid_pdrop) > 0
        self.embed_tokens = nn.Embedding(vocab, h)
        self.embed_dropout = KeyedDropout(cfg.embd_pdrop, 0)
        self.layers = nn.ModuleDict(
            {
                str(i): Starcoder2Layer(cfg, rotary, attention, i)
                for i in range(cfg.num_hidden_layers)
            }
        )
        self.norm = LayerNorm(h, cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.tie_weights()

    @property
    def tied_parameters(self) -> dict[str, str]:
        """Alias name -> owner name of tied parameters (the alias is the same tensor)."""
        return {"lm_head.weight": "embed_tokens.weight"}

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding's Parameter (when a stage holds both)."""
        if self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x: Tensor, positions: Tensor | None = None,
                token_keys: Tensor | None = None) -> Tensor:  # fmt: skip
        """Token ids [B, S] (or hidden states [B, S, h] on a later pipeline stage) -> logits.

        `positions` [B, S]: each token's index in its sample (given under context parallelism;
        None: 0..S-1). `token_keys` [B, S]: each token's dropout key (`models/dropout.py`);
        None in training: a random key per row.
        """
        if token_keys is None and self.training and self.has_dropout:
            token_keys = random_keys(x.shape[0], x.shape[1], x.device)
        if self.embed_tokens is not None:
            x = self.embed_dropout(self.embed_tokens(x), token_keys)  # (B, S, h)
        for layer in self.layers.values():
            x = layer(x, positions=positions, token_keys=token_keys)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x  # (B, S, V) or (B, S, h)
