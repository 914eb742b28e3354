"""Upper bounds on a config's sizes; part of `validate` (no torch import).

A huge YAML integer (2**63) passes `>= 1` and then crashes or hangs. Each size is bounded by
what torch indexes (int32); the run by limits no real run nears (Llama 3 405B: 16M tokens/step).
"""

from __future__ import annotations

from collections.abc import Iterator

from mesh3d.config.derive import global_batch_size, max_sequence_length, padded_vocab_size
from mesh3d.config.schema import Config

MAX_SIZE = 2**31 - 1
MAX_PARAMS = 10**13
MAX_STEP_TOKENS = 2**34


def too_large(key: str, value: int) -> str | None:
    """The message for a size above `MAX_SIZE`, else None."""
    if value <= MAX_SIZE:
        return None
    return f"`{key}` ({value}) is more than {MAX_SIZE} (2**31 - 1), the largest size torch indexes; lower it"


def scale_errors(cfg: Config) -> Iterator[str]:
    """The padded vocabulary, the parameter count (a lower bound) and the tokens per step."""
    mc, tokens = cfg.model.model_config, cfg.tokens
    vocab = padded_vocab_size(cfg)
    if vocab > MAX_SIZE:
        yield (
            f"`model.make_vocab_size_divisible_by` ({cfg.model.make_vocab_size_divisible_by}) x "
            f"parallelism.tp ({cfg.parallelism.tp}) pads the vocabulary to {vocab} rows, more than "
            f"{MAX_SIZE}; lower it (Nanotron's configs use 1 to 128)"
        )
    seq = max_sequence_length(cfg)
    step_tokens = global_batch_size(cfg) * seq
    if step_tokens > MAX_STEP_TOKENS:
        yield (
            f"one optimizer step would read {step_tokens} tokens (micro_batch_size "
            f"{tokens.micro_batch_size} x batch_accumulation_per_replica "
            f"{tokens.batch_accumulation_per_replica} x dp {cfg.parallelism.dp} x sequence_length "
            f"{seq}), more than {MAX_STEP_TOKENS} (2**34); lower "
            "tokens.batch_accumulation_per_replica or tokens.micro_batch_size"
        )
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers")
    if all(isinstance(getattr(mc, k, None), int) for k in sizes):
        h = mc.hidden_size
        # at least q and o projections and a gated MLP per layer, and one embedding
        per_layer = 2 * h * h + 3 * h * mc.intermediate_size
        params = mc.num_hidden_layers * per_layer + min(vocab, MAX_SIZE) * h
        if params > MAX_PARAMS:
            yield (
                f"the model would have more than {params:.3g} parameters (num_hidden_layers "
                f"{mc.num_hidden_layers}, hidden_size {h}, intermediate_size "
                f"{mc.intermediate_size}), more than {MAX_PARAMS:.0e}; lower "
                "model.model_config.num_hidden_layers or the sizes"
            )
