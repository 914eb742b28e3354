"""`mesh3d generate`: text from a checkpoint, to see what a run has learned.

    mesh3d generate --checkpoint checkpoints/ --prompt "Once upon a time" [--max-new-tokens 50]
        [--temperature 0.8 --top-k 50 --seed 1] [--tokenizer PATH] [--device cpu]
    python -m mesh3d.generate ...   # the same
    torchrun --nproc_per_node=4 -m mesh3d.generate ... --tp 2 --pp 2   # the parallel model

`--checkpoint` is a step folder, a checkpoints folder (its `latest.txt` step) or a folder
`mesh3d.convert from-hf` wrote; mesh3d's and Nanotron's step folders load whatever tp/pp saved
them. The tokenizer is `--tokenizer` when given, else `<step>/tokenizer/` (saved
with the checkpoint), else the config's `tokenizer.tokenizer_name_or_path` when it is a local
path. Greedy by default (temperature 0: the most likely token, as transformers' `generate` with
`do_sample=False`); with a temperature > 0 it samples from softmax(logits / T), over the top-k
tokens when `--top-k` is given, reproducibly for a `--seed`. It stops after `--max-new-tokens`
or at the model config's `eos_token_id`, and prints the prompt followed by the generated text.

One process runs the single-device model: fp32 on CPU, the checkpoint's dtype on CUDA (or as
`--device` says). Each new token is a plain forward over the whole sequence (no KV cache):
simple, and fast enough for a look at a small model. Under torchrun (WORLD_SIZE > 1) the
model runs at `--tp` x `--pp` = the number of processes (dp 1), built and loaded as training
does: `generate_parallel.py`; a layout that does not fit stops every rank before any
communication.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from mesh3d.checkpoint.hf import read_model_config_json, shape_of
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.checkpoint.tokenizer_files import config_tokenizer, saved_config, step_tokenizer
from mesh3d.checkpoint.training import weights_dir
from mesh3d.data.tokenize import load_tokenizer
from mesh3d.errors import UserError, exit_on_user_error
from mesh3d.mesh import resolve_device
from mesh3d.models.spec import spec_of


def next_token(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """The next token of each row of `logits` [B, V]: the argmax at temperature 0, else a
    sample from softmax(logits / temperature), restricted to the `top_k` largest when given."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits.float() / temperature
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
    """`ids` [S] or [B, S] followed by up to `max_new_tokens` tokens, each row's next token
    `pick(out)` [B] for the sequence so far `out` [B, S']. A row that produced `eos` is
    finished: it gets `eos` again while others go on (transformers pads with eos when there is
    no pad token), and generation stops when every row is."""
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
             ) -> Tensor:  # fmt: skip
    """`ids` [S] or [B, S] (on the model's device) followed by up to `max_new_tokens` tokens.

    `model(ids)` gives logits [B, S, V] (mesh3d's models; an object with `.logits`, as
    transformers' models return, works too). Greedy at `temperature` 0, else sampled (see
    `next_token`) with `generator`; `eos` ends a row (see `extend`). `vocab_size`: never pick
    ids at or above it (vocabulary padding). Each step runs the model over the whole sequence
    (no KV cache), under `torch.no_grad`.

    Example:

        out = mesh3d.generate.generate(model, torch.tensor([1, 5, 9]), 20, eos=2)
    """
    check_sampling(max_new_tokens, temperature, top_k)

    def pick(out: Tensor) -> Tensor:
        logits = model(out)
        logits = getattr(logits, "logits", logits)[:, -1, :vocab_size]  # (B, V)
        return next_token(logits, temperature, top_k, generator)

    return extend(ids, max_new_tokens, pick, eos)


def load_model(step: Path, device: torch.device) -> tuple[nn.Module, object]:
    """The single-device model of a step folder with its full weights; its model config."""
    mc = read_model_config_json(step)
    if not (step / "model").is_dir():
        raise UserError(f"{step} has no model/ folder of weights; give a checkpoint step folder")
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


def _unpadded_vocab(step: Path, padded: int) -> int:
    """The trained vocabulary (config.yaml's `vocab_size`; model_config.json has it padded)."""
    mc = (saved_config(step).get("model") or {}).get("model_config") or {}
    vocab = mc.get("vocab_size") if isinstance(mc, dict) else None
    return vocab if isinstance(vocab, int) and 0 < vocab <= padded else padded


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mesh3d generate", description=__doc__.split("\n\n")[0],
        epilog="greedy by default; the tokenizer: --tokenizer, else <step>/tokenizer/, else "
        "the checkpoint config's tokenizer when it is a local path; under torchrun the model "
        "runs at --tp x --pp = the number of processes",
    )  # fmt: skip
    ap.add_argument("--checkpoint", required=True, help="step folder or checkpoints folder")
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=50, help="default 50")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    ap.add_argument("--seed", type=int, default=42, help="sampling seed (default 42)")
    ap.add_argument("--tokenizer", help="tokenizer.json or a folder holding one")
    ap.add_argument("--tp", type=int, help="tensor-parallel degree (default: processes / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto (default): cuda when torch sees a GPU, else cpu")  # fmt: skip
    return ap


def _check_flags(args) -> None:
    bad = []
    if args.max_new_tokens < 1:
        bad.append(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.temperature < 0:
        bad.append(f"--temperature {args.temperature} must be >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        bad.append(f"--top-k {args.top_k} must be >= 1 (leave it out for no top-k)")
    for flag, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value is not None and value < 1:
            bad.append(f"{flag} {value} must be >= 1")
    if bad:
        raise UserError("; ".join(bad))


def _degrees(args, world: int) -> tuple[int, int]:
    """(tp, pp) from the flags; tp defaults to the processes pp leaves. Generation runs at dp 1,
    so tp x pp must be the number of processes."""
    tp = args.tp if args.tp is not None else max(1, world // args.pp)
    if tp * args.pp != world:
        launched = "this is one process (no torchrun)" if world == 1 else f"{world} were launched"
        raise UserError(
            f"--tp {tp} x --pp {args.pp} = {tp * args.pp} processes, but {launched}; generation "
            f"runs at dp 1, so launch torchrun --nproc_per_node={tp * args.pp} -m "
            f"mesh3d.generate ..., or give a --tp and --pp whose product is {world}"
        )
    return tp, args.pp


def _prompt_ids(tokenizer, args, step: Path, tok_path: str) -> list[int]:
    """The prompt's token ids, checked against the checkpoint's vocabulary."""
    prompt_ids = tokenizer.encode(args.prompt).ids
    vocab = read_model_config_json(step).vocab_size  # checked before the weights are read
    if not prompt_ids:
        raise UserError(f"--prompt {args.prompt!r} gives no tokens; give some text")
    if max(prompt_ids) >= vocab:
        raise UserError(
            f"tokenizer {tok_path} gives id {max(prompt_ids)}, but the model's vocabulary has "
            f"{vocab} ids: it is not this checkpoint's tokenizer; pass --tokenizer"
        )
    return prompt_ids


def _generate_here(step: Path, prompt_ids: list[int], args) -> tuple[list[int], str]:
    """The new token ids on this one process, and how they were made."""
    device = resolve_device(args.device)
    model, mc = load_model(step, device)
    generator = torch.Generator(device).manual_seed(args.seed)
    start = time.perf_counter()
    out = generate(model, torch.tensor(prompt_ids, device=device), args.max_new_tokens,
                   args.temperature, args.top_k, mc.eos_token_id, generator,
                   vocab_size=_unpadded_vocab(step, mc.vocab_size))  # fmt: skip
    took = time.perf_counter() - start
    return out[len(prompt_ids) :].tolist(), f"in {took:.1f} s on {device.type}"


def _continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text `new_ids` add after the prompt (decoded together, so a word split across the
    boundary reads right)."""
    before = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    after = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
    if after.startswith(before):
        return after[len(before) :]
    return tokenizer.decode(new_ids, skip_special_tokens=True)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _check_flags(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = _degrees(args, world)  # before any collective: a wrong layout never hangs
    step = weights_dir(args.checkpoint, "--checkpoint")
    tok_path, where = find_tokenizer(step, args.tokenizer)
    tokenizer = load_tokenizer(tok_path)
    prompt_ids = _prompt_ids(tokenizer, args, step, tok_path)
    first = int(os.environ.get("RANK", "0")) == 0
    positions = read_model_config_json(step).max_position_embeddings
    if first and len(prompt_ids) + args.max_new_tokens > positions:
        print(f"note: past {positions} tokens (max_position_embeddings) the model was not "
              "trained; expect worse text there", file=sys.stderr)  # fmt: skip
    if world == 1:
        new_ids, how = _generate_here(step, prompt_ids, args)
    else:  # the training stack (build, pipeline, checkpoint loading) only under torchrun
        from mesh3d.generate_parallel import generate_cli

        new_ids, how = generate_cli(step, prompt_ids, args, tp, pp)
    if first:
        print(f"{step}: tokenizer {tok_path} ({where}); {len(new_ids)} new tokens {how}",
              file=sys.stderr)  # fmt: skip
        print(args.prompt + _continuation(tokenizer, prompt_ids, new_ids))


if __name__ == "__main__":
    main()
