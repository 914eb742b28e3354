"""Generation on one process: the single-device model of a step folder with its full weights
(any layout wrote them), its tokenizer, and the new tokens for a prompt.

The prompt runs once and each new token is one forward of that token against the keys and
values kept so far (a KV cache, `generation/cache.py`); `--no-cache` runs the whole sequence
for every token instead (the same tokens, slower).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from mesh3d import extensions
from mesh3d.checkpoint.model_config import read_model_config_json, shape_of
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.checkpoint.tokenizer_files import config_tokenizer, saved_config, step_tokenizer
from mesh3d.checkpoint.training import lora_of
from mesh3d.errors import UserError
from mesh3d.generation.sampling import generate
from mesh3d.mesh import resolve_device
from mesh3d.models.registry import spec_of


def load_model(step: Path, device: torch.device) -> tuple[nn.Module, object]:
    """The single-device model of a step folder with its full weights; its model config."""
    mc = read_model_config_json(step)
    if not (step / "model").is_dir():
        raise UserError(f"{step} has no model/ folder of weights; give a checkpoint step folder")
    if lora_of(step) is not None:  # a LoRA run's: its base with the adapters merged
        full = extensions.load("lora_files").merged_weights(step)
    else:
        full = read_nanotron_weights(step / "model", shape_of(mc))
    with torch.device("meta"):  # no random init: every tensor comes from the files
        model = spec_of(mc).build(mc, vocab_size=mc.vocab_size, attention="auto")
    missing, unexpected = model.load_state_dict(full, strict=False, assign=True)
    assert not unexpected and set(missing) <= set(model.tied_parameters), (missing, unexpected)
    model.tie_weights()
    dtype = torch.float32 if device.type == "cpu" else full["embed_tokens.weight"].dtype
    return model.to(device=device, dtype=dtype).eval(), mc


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
    return out, (f"in {took:.1f} s on {device.type} ({batch}{how}, "
                 f"{new / max(took, 1e-9):.1f} tokens/s)")  # fmt: skip
