"""Picking tokens (greedy, or sampled with temperature, top-k and a seeded generator) and the
loop that extends a batch until each row ends at EOS or the budget is spent."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def next_token(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """The next token of each row of `logits` [B, V]: argmax at temperature 0, else sampled
    from softmax(logits / temperature), among the `top_k` largest when given."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    scaled = logits.float() / temperature
    if not scaled.amax(dim=-1).isfinite().all():  # a temperature so small that this overflowed:
        logits = logits.double()  # in float64, the largest shifted to 0 first (the rest -> -inf)
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    logits = scaled
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    where = generator.device if generator is not None else probs.device
    picked = torch.multinomial(probs.to(where), 1, generator=generator)  # (B, 1)
    return picked.squeeze(-1).to(logits.device)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Raise `ValueError` for settings `generate` cannot use."""
    if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(
            f"need max_new_tokens >= 0 ({max_new_tokens}), temperature >= 0 ({temperature}) "
            f"and top_k >= 1 or None ({top_k})"
        )


def extend(ids: Tensor, max_new_tokens: int, pick: Callable[[Tensor], Tensor],
           eos: int | None = None) -> Tensor:  # fmt: skip
    """`ids` [S] or [B, S] followed by up to `max_new_tokens` tokens `pick(out)` [B]; a row
    that produced `eos` gets `eos` again until every row has (as transformers pads)."""
    out = ids[None] if ids.dim() == 1 else ids  # (B, S)
    done = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for _ in range(max_new_tokens):
        tok = pick(out)  # (B,)
        if eos is not None:
            tok = torch.where(done, eos, tok)
            done |= tok == eos
        out = torch.cat([out, tok[:, None].to(out.dtype)], dim=1)  # (B, S + 1)
        if done.all():
            break
    return out[0] if ids.dim() == 1 else out


@torch.no_grad()
def generate(model: nn.Module, ids: Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos: int | None = None,
             generator: torch.Generator | None = None, *, vocab_size: int | None = None,
             cache: bool = True, pads: Tensor | None = None) -> Tensor:  # fmt: skip
    """`ids` [S] or [B, S] (on the model's device) followed by up to `max_new_tokens` tokens.

    `model(ids)` gives logits [B, S, V] (or `.logits`). `vocab_size`: never pick ids at or above
    it. `cache` (mesh3d's models): one forward per new token against a KV cache, same tokens.
    `pads` [B]: row b starts with `pads[b]` padding tokens (`cache.left_pad`), never attended to.

    Example:

        out = mesh3d.generation.sampling.generate(model, torch.tensor([1, 5, 9]), 20, eos=2)
    """
    check_sampling(max_new_tokens, temperature, top_k)
    if cache and max_new_tokens > 0 and any(hasattr(m, "kv") for m in model.modules()):
        return _generate_cached(model, ids, max_new_tokens, temperature, top_k, eos, generator,
                                vocab_size, pads)  # fmt: skip

    def pick(out: Tensor) -> Tensor:
        if pads is None:
            logits = model(out)
        else:  # padding at position 0: each padding token its own document, then the prompt
            from mesh3d.generation.cache import pad_positions

            logits = model(out, positions=pad_positions(pads.to(out.device), 0, out.shape[1]))
        logits = getattr(logits, "logits", logits)[:, -1, :vocab_size]  # (B, V)
        return next_token(logits, temperature, top_k, generator)

    return extend(ids, max_new_tokens, pick, eos)


def _generate_cached(model, ids, max_new_tokens, temperature, top_k, eos, generator, vocab_size,
                     pads=None):  # fmt: skip
    """`generate` with a KV cache: the prompt once, then one token per forward."""
    from mesh3d.generation.cache import KVCache, pad_positions

    state = {"fed": 0}

    def pick(out: Tensor) -> Tensor:  # out: (B, S)
        new = out[:, state["fed"] :]  # what the cache has not seen: the prompt, then 1 token
        if pads is None:
            at = torch.arange(state["fed"], out.shape[1], device=out.device).expand(len(out), -1)
        else:
            at = pad_positions(pads.to(out.device), state["fed"], out.shape[1])
        logits = model(new, positions=at)[:, -1, :vocab_size]  # (B, V)
        state["fed"] = out.shape[1]
        return next_token(logits, temperature, top_k, generator)

    if pads is not None:
        pads = pads.to(ids.device)
    with KVCache(model, ids.shape[-1] + max_new_tokens, pads):
        return extend(ids, max_new_tokens, pick, eos)
