"""Single-device Qwen2 as Nanotron's `Qwen2Config` defines it (SmolLM3 was trained with it).

Llama's blocks (`models/llama.py`), with per-layer attention switches:
- `attention_bias`: q/k/v projections with a bias (never o_proj);
- `no_rope_layer` k: every k-th layer (0-based index i with (i + 1) % k == 0) has no RoPE
  (SmolLM3's NoPE layers), and, as in Nanotron, no sliding window either;
- `sliding_window_size` W: every other layer sees its last W keys (itself included);
- `_use_doc_masking`: attention within each document, positions restarting at 0 in each (the
  model gets `positions`; the data supplies them);
- `rope_seq_len_interpolation_factor`: positions divided by it before RoPE;
- `moe_config`: the MLP of the layers it names is a mixture of experts (`models/moe.py`).
"""

from __future__ import annotations

from mesh3d.models.llama import Llama, activation
from mesh3d.models.moe import MoE, moe_layers


def nope_layer(cfg, i: int) -> bool:
    """Whether layer `i` (0-based) has no RoPE: every `no_rope_layer`-th, counted from 1."""
    k = getattr(cfg, "no_rope_layer", None)
    return k is not None and (i + 1) % k == 0


class Qwen2(Llama):
    """Qwen2 for causal LM: ids [B, S] (and positions [B, S]) -> logits [B, S, V].

    Example:

        with torch.device("meta"):
            model = Qwen2(cfg.model.model_config, vocab_size=padded_vocab)
    """

    def __init__(self, cfg, vocab_size: int | None = None, attention: str = "auto"):
        super().__init__(cfg, vocab_size=vocab_size, attention=attention)
        layers = moe_layers(cfg)
        norm_topk = bool(getattr(cfg, "norm_topk_prob", False))  # Qwen3's mesh3d.norm_topk_prob
        for i in layers:
            act = activation(cfg.hidden_act)
            self.layers[str(i)].mlp = MoE(cfg.hidden_size, cfg.moe_config, act, len(layers),
                                          norm_topk_prob=norm_topk)  # fmt: skip

    @staticmethod
    def layer_options(cfg, i: int) -> dict:
        nope = nope_layer(cfg, i)
        return {
            "bias": bool(cfg.attention_bias),
            "rope": not nope,
            "window": None if nope else cfg.sliding_window_size,
        }
