"""Named model shapes for `mesh3d plan --preset NAME`: the `model.model_config` keys of common
published models, so planning Llama 3 8B is one flag instead of a dozen dotted overrides.

The numbers are the architecture of each model's published `config.json` on the Hugging Face
Hub (meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.1-405B, HuggingFaceTB/SmolLM-135M,
-360M, -1.7B); all are Llama-architecture models. A preset sets only `model.model_config`:
dtype, sequence length, batch and layout stay the config's, and dotted overrides given after
it win (`mesh3d plan --preset llama3-8b model.dtype=bfloat16 tokens.sequence_length=8192`).
"""

from __future__ import annotations

from mesh3d.errors import UserError

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False)  # fmt: skip
_SMOLLM = dict(vocab_size=49152, rope_theta=10000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, max_position_embeddings=2048)  # fmt: skip

# name -> model_config keys (hidden, layers, heads, kv heads, MLP width, then the family's)
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336,
                      max_position_embeddings=8192, **_LLAMA3),
    "llama3-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672,
                       max_position_embeddings=8192, **_LLAMA3),
    "llama3-405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                        num_key_value_heads=8, intermediate_size=53248,
                        max_position_embeddings=131072, **_LLAMA3),  # Llama 3.1: no 3.0 405B
    "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, intermediate_size=1536, **_SMOLLM),
    "smollm-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15,
                        num_key_value_heads=5, intermediate_size=2560, **_SMOLLM),
    "smollm-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                        num_key_value_heads=32, intermediate_size=8192, **_SMOLLM),
}  # fmt: skip


def preset_overrides(name: str) -> list[str]:
    """The dotted overrides of preset `name` (to go before the user's, which then win)."""
    if name not in PRESETS:
        raise UserError(
            f"--preset {name}: no such preset; use one of {', '.join(PRESETS)}, or give the "
            "model_config keys as overrides (model.model_config.hidden_size=...)"
        )
    return [f"model.model_config.{k}={v}" for k, v in PRESETS[name].items()]
