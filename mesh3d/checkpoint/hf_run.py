"""Hugging Face folders inside a run: `init_method: {path: <HF folder>}` reads one at any
layout as `from-hf` would (`read_hf_for_run`), and `mesh3d.hf_export` writes one beside each
committed step folder (`export_hf`, run by the `Checkpointer`'s commit hook `ExportHook`). The conversion itself is `hf.py`'s."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from torch import Tensor

from mesh3d.checkpoint.folder import is_hf_folder
from mesh3d.checkpoint.hf import (
    _pad_rows,
    hf_config_of,
    hf_to_ours,
    permute_qk,
    read_hf_weights,
    shape_of,
    to_hf,
)
from mesh3d.checkpoint.manager import one_line
from mesh3d.errors import CheckpointWriteError, UserError
from mesh3d.log import logger


class ExportHook:
    """`mesh3d.hf_export` as a commit hook (`checkpoint/manager.py`): every committed step
    (`True`) or every multiple of the interval into `<checkpoints>/hf/<step>`. A failure is a
    `CheckpointWriteError` naming both folders (the checkpoint itself is complete)."""

    def __init__(self, setting: bool | int, root: Path):
        self.setting, self.root = setting, root

    def committed(self, final: Path) -> None:
        setting = self.setting
        if not (setting if isinstance(setting, bool) else int(final.name) % setting == 0):
            return
        output = self.root / "hf" / final.name
        try:
            out = export_hf(final, output)
        except Exception as e:  # noqa: BLE001 - one line, the same on every rank (the manager)
            raise CheckpointWriteError(
                f"mesh3d.hf_export: cannot write the Hugging Face model of {final} to {output}: "
                f"{one_line(e)}. The checkpoint itself is complete; free the folder or set "
                "mesh3d.hf_export: false"
            ) from e
        logger.info(f"Wrote the Hugging Face model {out}")


def export_hf(step_dir: Path, output: Path) -> Path:
    """`to_hf` of a committed step folder into `output`, written beside it first and renamed
    into place (`mesh3d.hf_export`): a crash never leaves a half folder under that name."""
    tmp = output.parent / f".tmp-{output.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    to_hf(step_dir, tmp)
    if output.exists():
        shutil.rmtree(output)
    os.replace(tmp, output)
    return output


# model_config fields that do not change the weights or the math of training: not compared
_FREE = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                   "max_position_embeddings", "use_cache", "pretraining_tp", "is_llama_config",
                   "is_qwen2_config", "is_starcoder2_config", "z_loss_enabled",
                   "z_loss_coefficient", "rope_interleaved", "vocab_size"})  # fmt: skip


def config_differences(ours, theirs) -> list[str]:
    """'key: ours vs theirs' for each model_config field that changes the weights or the math."""
    a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    if type(ours) is not type(theirs):
        return [f"family: {type(ours).__name__} vs {type(theirs).__name__}"]
    return [
        f"{k}: {a[k]!r} vs {b.get(k)!r}"
        for k in a
        if k not in _FREE and not k.startswith("_") and a[k] != b.get(k)
    ]


def read_hf_for_run(model_dir: Path, mc, padded_vocab: int) -> dict[str, Tensor]:
    """Our name -> full tensor of the HF folder `model_dir` for a run whose model config is
    `mc`, with the vocabulary rows padded to `padded_vocab` (and q/k permuted for
    `rope_interleaved`): what `from-hf` would write, without writing it. A config that
    differs from the folder's `config.json` in a field that matters is refused, listed."""
    theirs, arch = hf_config_of(model_dir)
    diff = config_differences(mc, theirs)
    if diff:
        raise UserError(
            f"`model.init_method.path` {model_dir} holds another model than model.model_config "
            f"(config vs its config.json): {'; '.join(diff)}. Set model_config as that folder "
            f"says (`mesh3d convert from-hf --model {model_dir} --output <dir>` writes a "
            "config.yaml that does)"
        )
    if mc.vocab_size != theirs.vocab_size:
        raise UserError(
            f"`model.model_config.vocab_size` {mc.vocab_size} differs from {model_dir}'s "
            f"config.json ({theirs.vocab_size}); set it to {theirs.vocab_size}"
        )
    ours = hf_to_ours(read_hf_weights(model_dir), theirs, model_dir, arch)
    for k in ("embed_tokens.weight", "lm_head.weight"):
        if k in ours:
            ours[k] = _pad_rows(ours[k], padded_vocab)
    if getattr(mc, "rope_interleaved", False):
        ours = permute_qk(ours, shape_of(theirs).head_dim, to_interleaved=True)
    return ours


def checkpoint_vocab(path: Path) -> tuple[int | None, str]:
    """(vocabulary size, the file that says it) of `init_method.path`: an HF folder's
    config.json, a step folder's config.yaml (the unpadded vocabulary) or model_config.json;
    (None, "") when none says it."""
    import json

    from mesh3d.checkpoint.tokenizer_files import saved_config

    step = path if (path / "model").is_dir() or is_hf_folder(path) else path.parent
    if is_hf_folder(step):
        found = [(step / "config.json", "vocab_size")]
    else:
        mc = (saved_config(step).get("model") or {}).get("model_config") or {}
        if isinstance(mc, dict) and isinstance(mc.get("vocab_size"), int):
            return mc["vocab_size"], str(step / "config.yaml")
        found = [(step / "model_config.json", "vocab_size")]
    for file, key in found:
        try:
            value = json.loads(file.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return value, str(file)
    return None, ""


def check_init_tokenizer(init_path: str, tokenizer_path: str) -> None:
    """Raise `UserError` when fine-tuning from `init_path` (a mesh3d/Nanotron step folder or
    an HF folder) with a tokenizer the checkpoint cannot embed: its EOS id, or any of its ids,
    at or past the checkpoint's vocabulary."""
    from mesh3d.data.tokenizer import EOS_CANDIDATES, find_eos, load_tokenizer

    vocab, file = checkpoint_vocab(Path(init_path))
    if vocab is None:
        return
    tok = load_tokenizer(tokenizer_path)
    n, eos = tok.get_vocab_size(with_added_tokens=True), find_eos(tok)
    fix = ("use the tokenizer the checkpoint was trained with (a step folder keeps it in "
           "tokenizer/) as tokenizer.tokenizer_name_or_path")  # fmt: skip
    if eos is not None and eos >= vocab:
        name = next(t for t in EOS_CANDIDATES if tok.token_to_id(t) == eos)
        raise UserError(
            f"tokenizer {tokenizer_path!r}: its EOS token {name!r} is id {eos}, outside the "
            f"{vocab} ids of model.init_method.path {init_path} ({file}), so SFT would train "
            f"an id the checkpoint has no embedding for; {fix}"
        )
    if n > vocab:
        raise UserError(
            f"tokenizer {tokenizer_path!r} has {n} ids (with added tokens) but model."
            f"init_method.path {init_path} has a vocabulary of {vocab} ids ({file}); {fix}"
        )
