"""Single-device Mamba-1 (Nanotron's examples/mamba; Hugging Face `MambaForCausalLM`).

Each layer is `x + mixer(norm(x))` (the residual in fp32 with `residual_in_fp32`), the mixer a
selective state-space scan per channel:

    x, z = in_proj(h)                    # (B, S, d_inner) each; d_inner = expand * d_model
    x = silu(causal depthwise conv1d(x)) # width d_conv, per channel
    dt, B, C = x_proj(x)                 # dt_rank, d_state, d_state
    dt = softplus(dt_proj(dt))           # (B, S, d_inner)
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,  y_t = C_t h_t + D x_t   (A = -exp(A_log))
    out = out_proj(y * silu(z))

Notable choices:
- `in_proj`'s rows interleave x and z (x0, z0, x1, z1, ...), as Nanotron's checkpoints hold
  them: a tensor-parallel rank's contiguous block of rows is then its channels of both, the
  channels its share of conv1d, dt_proj, A_log and D covers. HF's rows are x then z
  (`models/mamba_spec.py` converts).
- The scan is plain torch (fp32, a loop over the sequence), correct on every device; on CUDA
  with `ssm_cfg.use_fast_path` and `mamba-ssm` / `causal-conv1d` installed, their kernels run
  the same math.
- Shapes come from tensors, so a tensor-parallel shard with fewer channels runs this code.
  The mixer reads `A_log`, `D` and `conv1d`'s tensors itself (under tp,
  `tp_family_styles.LocalChannels` hands it this rank's rows); everything else goes through its
  module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.models.llama import RMSNorm

try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
except ImportError:
    selective_scan_fn = None
try:
    from causal_conv1d import causal_conv1d_fn
except ImportError:
    causal_conv1d_fn = None


def ssm_sizes(mc) -> tuple[int, int, int, int]:
    """(d_inner, d_state, d_conv, dt_rank) of a MambaConfig (`ssm_cfg: null`: the defaults)."""
    from mesh3d.config.mamba import MambaSSMConfig

    ssm = mc.ssm_cfg or MambaSSMConfig()
    dt_rank = math.ceil(mc.d_model / 16) if ssm.dt_rank == "auto" else int(ssm.dt_rank)
    return ssm.expand * mc.d_model, ssm.d_state, ssm.d_conv, dt_rank


def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                   z: Tensor) -> Tensor:  # fmt: skip
    """y = scan(x) + D x, gated by silu(z), in fp32; x, dt, z (B, d, S), A (d, N), B, C (B, S, N)
    (dt after softplus) -> (B, d, S) in x's dtype."""
    dtype = x.dtype
    x, dt, z = x.float(), dt.float(), z.float()
    B, C = B.float(), C.float()
    # time first, so that each step reads a contiguous (B, d, N) slice and backward stacks
    # the slices' gradients once (a slice of dim 2 would allocate a full-size gradient per step)
    dt_s = dt.permute(2, 0, 1).unsqueeze(-1)  # (S, B, d, 1)
    dA = torch.exp(dt_s * A)  # (S, B, d, N)
    dBx = dt_s * x.permute(2, 0, 1).unsqueeze(-1) * B.transpose(0, 1).unsqueeze(2)  # (S, B, d, N)
    state = x.new_zeros(x.shape[0], x.shape[1], A.shape[1])  # (B, d, N)
    states = []
    for a, bx in zip(dA.unbind(0), dBx.unbind(0)):
        state = a * state + bx
        states.append(state)
    y = torch.einsum("sbdn,bsn->bds", torch.stack(states), C)  # (B, d, S)
    y = y + x * D.float()[:, None]
    return (y * F.silu(z)).to(dtype)


class MambaMixer(nn.Module):
    """The selective state-space mixer of one layer: (B, S, d_model) -> (B, S, d_model)."""

    def __init__(self, d_model: int, mc):
        super().__init__()
        d_inner, d_state, d_conv, dt_rank = ssm_sizes(mc)
        ssm = mc.ssm_cfg
        self.split = (dt_rank, d_state, d_state)
        self.fast_path = ssm is None or ssm.use_fast_path
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)  # rows x0, z0, x1, z1, ...
        conv_bias = ssm is None or ssm.conv_bias
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def _kernels(self, x: Tensor) -> bool:
        return self.fast_path and x.is_cuda and selective_scan_fn is not None

    def _conv(self, x: Tensor) -> Tensor:
        """silu(causal depthwise convolution) of x (B, d, S)."""
        w, b = self.conv1d.weight, self.conv1d.bias  # (d, 1, W), (d,)
        if self._kernels(x) and causal_conv1d_fn is not None:
            return causal_conv1d_fn(x, w.squeeze(1), b, activation="silu")
        width = w.shape[-1]
        return F.silu(F.conv1d(F.pad(x, (width - 1, 0)), w, b, groups=x.shape[1]))

    def forward(self, h: Tensor) -> Tensor:
        b, s, _ = h.shape
        x, z = self.in_proj(h).view(b, s, -1, 2).unbind(-1)  # (B, S, d) each
        x = self._conv(x.transpose(1, 2))  # (B, d, S)
        dt, B, C = self.x_proj(x.transpose(1, 2)).split(self.split, dim=-1)  # (B, S, .)
        dt = self.dt_proj(dt).transpose(1, 2)  # (B, d, S), before softplus
        A = -torch.exp(self.A_log.float())  # (d, N)
        if self._kernels(x):
            y = selective_scan_fn(x, dt.contiguous(), A, B.transpose(1, 2).contiguous(),
                                  C.transpose(1, 2).contiguous(), self.D.float(),
                                  z=z.transpose(1, 2).contiguous(), delta_softplus=True)  # fmt: skip
        else:
            y = selective_scan(x, F.softplus(dt.float()), A, B, C, self.D, z.transpose(1, 2))
        return self.out_proj(y.transpose(1, 2))  # (B, S, d_model)


class MambaLayer(nn.Module):
    """x + mixer(norm(x)); the sum in fp32 with `residual_in_fp32` (HF's `MambaBlock`)."""

    def __init__(self, mc):
        super().__init__()
        self.norm = RMSNorm(mc.d_model, mc.rms_norm_eps)
        self.mixer = MambaMixer(mc.d_model, mc)
        self.residual_in_fp32 = mc.residual_in_fp32

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        out = self.mixer(self.norm(x.to(self.norm.weight.dtype)))
        return (x.float() if self.residual_in_fp32 else x) + out


class Mamba(nn.Module):
    """Mamba-1 for causal LM: ids [B, S] -> logits [B, S, V] (V = padded `vocab_size`);
    embeddings tied to the head (Nanotron's example and HF's default).

    Example:

        with torch.device("meta"):
            model = Mamba(cfg.model.model_config, vocab_size=padded_vocab)
    """

    tie_word_embeddings = True

    def __init__(self, mc, vocab_size: int | None = None, attention: str = "auto"):
        super().__init__()
        vocab = vocab_size or mc.vocab_size
        self.embed_tokens = nn.Embedding(vocab, mc.d_model)
        self.layers = nn.ModuleDict({str(i): MambaLayer(mc) for i in range(mc.num_hidden_layers)})
        self.norm = RMSNorm(mc.d_model, mc.rms_norm_eps)
        self.lm_head = nn.Linear(mc.d_model, vocab, bias=False)
        self.tie_weights()

    @property
    def tied_parameters(self) -> dict[str, str]:
        """Alias name -> owner name of tied parameters (the alias is the same tensor)."""
        return {"lm_head.weight": "embed_tokens.weight"}

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding's Parameter (when a stage holds both)."""
        if self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Token ids [B, S] (or hidden states [B, S, h] on a later pipeline stage) -> logits.
        The scan runs over the whole row: `positions` [B, S] other than 0..S-1 on every row
        (documents restarting inside a row, left-padded prompts) are refused, not ignored."""
        if positions is not None:
            plain = torch.arange(positions.shape[-1], device=positions.device)
            if not torch.equal(positions, plain.expand_as(positions)):
                raise ValueError(
                    "Mamba's scan cannot restart inside a row: positions other than 0..S-1 "
                    "(document masking, packed SFT rows, left-padded prompts) are not supported; "
                    "give one document or prompt per row"
                )
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (B, S, h)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is None:
            return x
        x = self.norm(x)
        if self.lm_head is None:
            return x
        return self.lm_head(x.to(self.lm_head.weight.dtype))  # (B, S, V)
