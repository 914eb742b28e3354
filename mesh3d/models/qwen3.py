"""Single-device Qwen3: Qwen2 (`models/qwen2.py`) with an RMSNorm over each q and k head before
RoPE (one weight of size head_dim each, shared by the heads) and a head size that need not be
hidden_size / num_attention_heads. With a `moe_config` it is Qwen3-MoE: Qwen2's MoE layers,
usually without the shared expert and with `norm_topk_prob` (`models/moe.py`). Nanotron has no
Qwen3; its config is a Qwen2 one with `mesh3d: {model_family: qwen3, head_dim: ...,
norm_topk_prob: ...}` (`Qwen3Config` once loaded).
"""

from __future__ import annotations

from mesh3d.models.qwen2 import Qwen2


class Qwen3(Qwen2):
    """Qwen3 for causal LM: ids [B, S] (and positions [B, S]) -> logits [B, S, V].

    Example:

        with torch.device("meta"):
            model = Qwen3(cfg.model.model_config, vocab_size=padded_vocab)
    """

    @staticmethod
    def layer_options(cfg, i: int) -> dict:
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        return {
            **Qwen2.layer_options(cfg, i),
            "head_dim": head_dim,
            "qk_norm_eps": cfg.rms_norm_eps,
        }
