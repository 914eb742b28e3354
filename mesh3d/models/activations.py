"""The activation functions and training dtypes a model config may name, without torch."""

from __future__ import annotations

# `hidden_act` -> (the torch.nn.functional function, its keyword arguments)
ACTIVATIONS: dict[str, tuple[str, dict]] = {
    "silu": ("silu", {}),
    "gelu": ("gelu", {}),
    "gelu_pytorch_tanh": ("gelu", {"approximate": "tanh"}),
    "relu": ("relu", {}),
}
HIDDEN_ACTS = tuple(sorted(ACTIVATIONS))
# the `model.dtype` values a run can train in
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
