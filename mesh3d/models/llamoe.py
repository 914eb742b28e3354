"""Single-device LlaMoE, Nanotron's examples/moe model (`is_llamoe_config`), torch only.

Llama's blocks (`models/llama.py`: attention with interleaved RoPE of theta 10000, RMSNorm,
pre-norm residuals) with every layer's MLP a mixture of experts, `models/moe.py`'s block with
the example's expert form:
- router: softmax of x · Wᵀ (W [E, h]) over the E = `moe_num_experts` experts, the top
  k = `num_experts_per_tok` probabilities taken as they are (not renormalized);
- expert e: w2ₑ · gelu_tanh(w1ₑ · x), ungated, of `intermediate_size` F;
- dropless: every token reaches its k experts (`moe_capacity_factor` is read by nothing in the
  example), and no load-balancing loss.

The experts are stored as the example's (megablocks-style) stacks, both [E·F, h], expert e's rows
e·F .. (e+1)·F: `w1` applied as x @ w1ₑᵀ, `w2` as a @ w2ₑ; its checkpoint holds them so
(`models/llamoe_spec.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mesh3d.models.llama import Llama
from mesh3d.models.moe import MoE

gelu_tanh = functools.partial(F.gelu, approximate="tanh")


class GeluExperts(nn.Module):
    """E ungated GELU experts as two [E·F, h] stacks (see the module doc)."""

    grouped_mm = False  # a loop over the experts that have rows (no grouped GEMM form yet)

    def __init__(self, num_experts: int, h: int, ffn: int):
        super().__init__()
        self.ffn = ffn
        self.w1 = nn.Parameter(torch.empty(num_experts * ffn, h))
        self.w2 = nn.Parameter(torch.empty(num_experts * ffn, h))

    def run(self, x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        """One expert (its [F, h] rows of w1 and w2) on tokens x [n, h]."""
        return gelu_tanh(x @ w1.T) @ w2

    def run_sorted(self, rows: Tensor, counts: Tensor, weights=lambda p: p) -> Tensor:
        """Every expert on its rows: `rows` [n, h] grouped by expert (counts[e] rows each, the
        experts this module holds); returns [n, h] in the same order."""
        w1s, w2s = weights(self.w1).split(self.ffn), weights(self.w2).split(self.ffn)
        parts = rows.split(counts.tolist())
        ran = [self.run(x, w1s[e], w2s[e]) for e, x in enumerate(parts) if len(x)]
        return torch.cat(ran) if ran else rows


class LlaMoEBlock(MoE):
    """`models/moe.py`'s block (routing, dispatch, expert parallelism) with GELU experts."""

    def __init__(self, h: int, moe, num_moe_layers: int):
        super().__init__(h, moe, gelu_tanh, num_moe_layers)
        self.experts = GeluExperts(moe.num_experts, h, moe.moe_intermediate_size)


class LlaMoE(Llama):
    """LlaMoE for causal LM: ids [B, S] (and positions [B, S]) -> logits [B, S, V].

    Example:

        with torch.device("meta"):
            model = LlaMoE(cfg.model.model_config, vocab_size=padded_vocab)
    """

    def __init__(self, cfg, vocab_size: int | None = None, attention: str = "auto"):
        super().__init__(cfg, vocab_size=vocab_size, attention=attention)
        n = cfg.num_hidden_layers
        for i in range(n):
            self.layers[str(i)].mlp = LlaMoEBlock(cfg.hidden_size, cfg.moe_config, n)
