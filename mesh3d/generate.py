"""`mesh3d generate`: text from a checkpoint, to see what a run has learned.

    mesh3d generate --checkpoint runs/default/checkpoints --prompt "Once upon a time" [--max-new-tokens 50]
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

`--prompts FILE` (or `--prompts-file`) gives one prompt per line; a `.jsonl` file gives one
JSON object per line, a chat `{"messages": [{"role": ..., "content": ...}, ...]}` rendered with
the tokenizer's chat template and its generation prompt (`data/chat.py`: the template beside the
tokenizer, else ChatML when the tokenizer has its tokens), or `{"prompt": "text"}`. The prompts
run as one batch, left-padded, each row continued as its prompt alone would be (greedy: token
for token), each stopping at EOS or `--max-new-tokens`, and each printed on its own: the prompt
(a chat as rendered) and its continuation, under a `--- prompt i of n ---` header with a blank
line between (one prompt: no header). A `--checkpoint` folder that does not exist is refused
naming the runs/*/checkpoints folders here (`mesh3d train` writes runs/<run name>/checkpoints). One process runs the single-device model: fp32 on
CPU, the checkpoint's dtype on CUDA (or as `--device` says), with a KV cache (the prompt once,
then one token per forward; `--no-cache` runs the whole sequence for every token). Under
torchrun (WORLD_SIZE > 1) the model runs at `--tp` x `--pp` = the number of processes (dp 1),
built and loaded as training does (`generation/parallel.py`), with a KV cache on every rank
too; a layout that does not fit stops every rank before any communication. This module is the command; the library is `mesh3d/generation/`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from mesh3d.checkpoint.hf import hf_model_of, read_model_config_json
from mesh3d.checkpoint.load import verified, weights_dir
from mesh3d.data.tokenizer import load_tokenizer
from mesh3d.errors import UserError, exit_on_user_error, on_every_rank
from mesh3d.generation.single import find_tokenizer, generate_here


class _PromptsFlag(argparse.Action):
    """Stores the file and which spelling named it (`--prompts` or `--prompts-file`), so a
    refusal names the flag the user typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.prompts_flag = option_string


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mesh3d generate", description=__doc__.split("\n\n")[0],
        epilog="greedy by default; the tokenizer: --tokenizer, else <step>/tokenizer/, else "
        "the checkpoint config's tokenizer when it is a local path; under torchrun the model "
        "runs at --tp x --pp = the number of processes",
    )  # fmt: skip
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="step folder or checkpoints folder (the default run's: runs/default/checkpoints)",
    )
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text to continue")
    which.add_argument("--prompts", "--prompts-file", dest="prompts", action=_PromptsFlag,
                       help="a text file, one prompt per line (empty lines skipped), or a .jsonl "
                       'file of chats {"messages": [{"role", "content"}...]} or {"prompt": text}')  # fmt: skip
    ap.set_defaults(prompts_flag="--prompts")
    ap.add_argument("--max-new-tokens", type=int, default=50, help="default 50")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    ap.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    ap.add_argument("--seed", type=int, default=42, help="sampling seed (default 42)")
    ap.add_argument("--tokenizer", help="tokenizer.json or a folder holding one")
    ap.add_argument("--tp", type=int, help="tensor-parallel degree (default: processes / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    ap.add_argument("--no-cache", action="store_true",
                    help="run the whole sequence for every new token (no KV cache)")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto (default): cuda when torch sees a GPU, else cpu")  # fmt: skip
    return ap


def _check_flags(args) -> None:
    bad = []
    if args.max_new_tokens < 1:
        bad.append(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        bad.append(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        bad.append(f"--top-k {args.top_k} must be >= 1 (leave it out for no top-k)")
    for flag, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value is not None and value < 1:
            bad.append(f"{flag} {value} must be >= 1")
    if bad:
        raise UserError("; ".join(bad))


def _check_cache_fits(args, mc, batch: int, longest: int, ranks: int) -> None:
    """Refuse a `--max-new-tokens` whose KV cache (keys and values of every layer, for the
    prompts and the new tokens) is larger than the memory that holds it, before any of it is
    allocated: a GPU's whole memory for its rank's share (tp x pp = `ranks` split it), the
    machine's RAM for all of it on CPU (every rank's share is in the same RAM)."""
    heads = getattr(mc, "num_key_value_heads", None) or getattr(mc, "num_attention_heads", None)
    layers = getattr(mc, "num_hidden_layers", None)
    if args.no_cache or not heads or not layers:
        return
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    import torch  # (the device and its memory; the import is already paid by the tokenizer)

    from mesh3d.mesh import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        itemsize, share = 2, ranks  # bf16 (a float32 checkpoint's is twice this: a loose bound)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        itemsize, share = 4, 1
    per_token = 2 * layers * batch * heads * head_dim * itemsize / share
    tokens = longest + args.max_new_tokens
    if per_token * tokens > memory:
        where = "this GPU" if device.type == "cuda" else "this machine's RAM"
        raise on_every_rank(UserError(
            f"--max-new-tokens {args.max_new_tokens}: the KV cache of {batch} x {tokens:,} "
            f"tokens needs {per_token * tokens / 2**30:,.1f} GiB, more than the "
            f"{memory / 2**30:,.1f} GiB of {where}; give at most "
            f"{max(int(memory / per_token) - longest, 1):,} (less in practice: the weights "
            "need room too)"
        ))  # fmt: skip


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


def _prompts(args) -> list[str | list[dict]]:
    """The prompts: `--prompt`, or the non-empty lines of the `--prompts` file (a chat's
    messages for a .jsonl line with "messages")."""
    if args.prompt is not None:
        return [args.prompt]
    path, flag = Path(args.prompts), args.prompts_flag
    if not path.is_file():
        raise UserError(
            f"{flag} {args.prompts!r} is not a file; give a text file, one prompt a line"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{flag} {args.prompts!r} is not UTF-8 text (byte {e.start}: "
            f"{e.object[e.start : e.start + 1]!r}); save it as UTF-8"
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"{flag} {args.prompts!r} has no non-empty line; give one prompt a line")
    if path.suffix != ".jsonl":
        return lines
    numbered = enumerate(text.splitlines(), 1)  # n: the file's line numbers
    return [_jsonl_prompt(line, path, n) for n, line in numbered if line.strip()]


def _jsonl_prompt(line: str, path: Path, n: int) -> str | list[dict]:
    import json

    from mesh3d.data.chat import check_messages

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {n} is not JSON ({e.msg}); give one object a line") from None
    if not isinstance(row, dict):
        raise UserError(f"{path} line {n} is not a JSON object; give one object a line")
    if "messages" in row:
        return check_messages(row["messages"], str(path), n - 1)  # it counts rows from 0
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    raise UserError(
        f'{path} line {n} has neither "messages" (a chat: a list of {{"role", "content"}}) nor '
        f'"prompt" (text); its keys: {", ".join(row)}'
    )


def _existing(checkpoint: str) -> str:
    """`checkpoint`, when it is a folder; else a refusal naming the checkpoints folders a run
    wrote under ./runs (`mesh3d train` writes runs/<run name>/checkpoints)."""
    if Path(checkpoint).is_dir():
        return checkpoint
    found = sorted(str(p) for p in Path("runs").glob("*/checkpoints") if p.is_dir())
    if "runs/default/checkpoints" in found:  # the default run's first
        found.insert(0, found.pop(found.index("runs/default/checkpoints")))
    where = f"--checkpoint {checkpoint}: no such folder in {Path.cwd()}"
    wrote = "`mesh3d train` writes runs/<run name>/checkpoints, relative to the folder it ran in"
    if not found:
        raise UserError(
            f"{where}, and no runs/*/checkpoints here either; give a step folder or a "
            f"checkpoints folder ({wrote})"
        )
    others = f" (or {', '.join(found[1:3])})" if len(found) > 1 else ""
    raise UserError(f"{where}; did you mean --checkpoint {found[0]}{others}? ({wrote})")


def _prompt_ids(tokenizer, prompt: str, step: Path, tok_path: str,
                template: bool = False) -> list[int]:  # fmt: skip
    """The prompt's token ids, checked against the checkpoint's vocabulary (a chat's rendering
    is tokenized without the tokenizer's own special tokens: the template writes them)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=not template).ids
    vocab = read_model_config_json(step).vocab_size  # checked before the weights are read
    if not prompt_ids:
        raise UserError(f"prompt {prompt!r} gives no tokens; give some text")
    if max(prompt_ids) >= vocab:
        raise UserError(
            f"tokenizer {tok_path} gives id {max(prompt_ids)}, but the model's vocabulary has "
            f"{vocab} ids: it is not this checkpoint's tokenizer; pass --tokenizer"
        )
    return prompt_ids


def _render(prompts: list, tok_path: str, args) -> tuple[list[str], list[bool]]:
    """The prompts as text, chats rendered with the tokenizer's chat template and the
    generation prompt; and which were chats."""
    chats = [isinstance(p, list) for p in prompts]
    if not any(chats):
        return prompts, chats
    from mesh3d.data.chat import conversation_renderer

    render = conversation_renderer(
        tok_path,
        f'{args.prompts_flag} {args.prompts} holds chats ("messages")',
        instead='give plain prompts (a text file, one prompt a line, or {"prompt": text} lines), '
        "or a --tokenizer that has a chat template (chat_template in its tokenizer_config.json, "
        "or a chat_template.jinja beside it)",
    )
    return [render(p, True) if chat else p for p, chat in zip(prompts, chats)], chats


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
    step = weights_dir(_existing(args.checkpoint), "--checkpoint")
    if hf_model_of(str(step)):  # a transformers model's (mesh3d.hf_model): not a family's
        raise UserError(
            f"{step} is a checkpoint of the transformers model {hf_model_of(str(step))} "
            f"(mesh3d.hf_model); export it with `mesh3d convert to-hf --checkpoint {step} "
            "--output DIR` and generate with transformers"
        )
    tok_path, where = find_tokenizer(step, args.tokenizer)
    tokenizer = load_tokenizer(tok_path)
    texts, chats = _render(_prompts(args), tok_path, args)
    prompts = [_prompt_ids(tokenizer, t, step, tok_path, c) for t, c in zip(texts, chats)]
    first = int(os.environ.get("RANK", "0")) == 0
    mc = read_model_config_json(step)
    positions = mc.max_position_embeddings
    longest = max(map(len, prompts))
    _check_cache_fits(args, mc, len(prompts), longest, tp * pp)
    if first and longest + args.max_new_tokens > positions:
        print(f"note: a {longest}-token prompt + --max-new-tokens {args.max_new_tokens} can go "
              f"past the {positions} tokens the model was trained on (max_position_embeddings); "
              "expect worse text there", file=sys.stderr)  # fmt: skip
    if world == 1:  # (under torchrun the training stack's loading verifies the files)
        new_ids, how = generate_here(verified(step), prompts, args)
    else:  # the training stack (build, pipeline, checkpoint loading) only under torchrun
        import torch.distributed as dist

        from mesh3d.generation.parallel import generate_cli
        from mesh3d.mesh import shutdown_distributed

        started = dist.is_initialized()  # a caller's group (tests, a library user) stays up
        new_ids, how = generate_cli(step, prompts, args, tp, pp)
        if not started:  # only after success: after an error a peer may be gone, and tearing
            shutdown_distributed()  # down could hang; the exit code says it failed anyway
    if first:
        total = sum(map(len, new_ids))
        print(f"{step}: tokenizer {tok_path} ({where}); {total} new tokens {how}",
              file=sys.stderr)  # fmt: skip
        for i, (text, ids, new) in enumerate(zip(texts, prompts, new_ids, strict=True), 1):
            if len(texts) > 1:  # a batch: each output under its own header
                print(f"{'' if i == 1 else chr(10)}--- prompt {i} of {len(texts)} ---")
            print(text + _continuation(tokenizer, ids, new))


if __name__ == "__main__":
    main()
