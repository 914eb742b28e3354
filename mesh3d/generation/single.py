"""Generation on one process (`mesh3d generate` without torchrun): a step folder's model
(`generation/load.py`), its tokenizer, and the new tokens for a prompt.

The prompt runs once and each new token is one forward of that token against the keys and
values kept so far (a KV cache, `generation/cache.py`); `--no-cache` runs the whole sequence
for every token instead (the same tokens, slower).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mesh3d.checkpoint.tokenizer_files import config_tokenizer, saved_config, step_tokenizer
from mesh3d.errors import UserError
from mesh3d.generation.load import load_model
from mesh3d.generation.sampling import generate
from mesh3d.mesh import resolve_device


def find_tokenizer(step: Path, flag: str | None) -> tuple[str, str]:
    """(tokenizer path, where it came from): `--tokenizer`, `<step>/tokenizer/`, config.yaml."""
    if flag:
        return flag, "--tokenizer"
    saved = step_tokenizer(step)
    if saved is not None:
        return str(saved), "saved with the checkpoint"
    named = config_tokenizer(step)
    if named and Path(named).exists():
        return named, f"{step / 'config.yaml'} tokenizer.tokenizer_name_or_path"
    said = f"; its config.yaml names {named!r}, which is not a local path" if named else ""
    raise UserError(
        f"no tokenizer for {step}: it has no tokenizer/ folder{said}. Give one with "
        "--tokenizer <folder with tokenizer.json | tokenizer.json> (a hub name must be "
        "downloaded first, e.g. `huggingface-cli download <repo id> tokenizer.json --local-dir <dir>`)"
    )


def unpadded_vocab(step: Path, padded: int) -> int:
    """The trained vocabulary (config.yaml's `vocab_size`; model_config.json has it padded)."""
    mc = (saved_config(step).get("model") or {}).get("model_config") or {}
    vocab = mc.get("vocab_size") if isinstance(mc, dict) else None
    return vocab if isinstance(vocab, int) and 0 < vocab <= padded else padded


def new_tokens(out: list[list[int]], start: int, eos: int | None) -> list[list[int]]:
    """Each row's tokens after its first `start` ones, up to and including its first `eos`
    (a finished row of a batch is filled with eos while the others go on)."""
    rows = []
    for row in out:
        new = row[start:]
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        rows.append(new)
    return rows


def generate_here(step: Path, prompts: list[list[int]], args) -> tuple[list[list[int]], str]:
    """The new token ids of each prompt on this one process (one model, the prompts as one
    left-padded batch: each row continues as its prompt alone would), and how they were made."""
    from mesh3d.generation.cache import left_pad

    device = resolve_device(args.device)
    model, mc = load_model(step, device)
    vocab = unpadded_vocab(step, mc.vocab_size)
    cache = not getattr(args, "no_cache", False)
    eos = mc.eos_token_id
    start = time.perf_counter()
    generator = torch.Generator(device).manual_seed(args.seed)
    ids, pads = left_pad(prompts, eos if eos is not None else 0)
    pads = pads if pads.any() else None
    got = generate(model, ids.to(device), args.max_new_tokens, args.temperature, args.top_k,
                   eos, generator, vocab_size=vocab, cache=cache, pads=pads)  # fmt: skip
    out = new_tokens(got.tolist(), ids.shape[1], eos)
    took = time.perf_counter() - start
    how = "KV cache" if cache else "no cache"
    new = sum(map(len, out))
    batch = f"{len(prompts)} prompts in one batch, " if len(prompts) > 1 else ""
    return out, (f"in {took:.1f} s at tp 1 x pp 1 on {device.type} ({batch}{how}, "
                 f"{new / max(took, 1e-9):.1f} tokens/s)")  # fmt: skip
