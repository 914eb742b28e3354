"""Loading a local `tokenizer.json` (the `tokenizers` library), its EOS id and vocabulary check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mesh3d.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a local `tokenizer.json` or a folder that holds one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.exists():
        raise UserError(
            f"tokenizer {str(path)!r} is not a local file or folder; mesh3d runs offline: download "
            "it first (e.g. `huggingface-cli download <repo id> tokenizer.json --local-dir <dir>`) "
            "and give the local folder or tokenizer.json"
        )
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(
            f"tokenizer folder {str(path)!r} has no tokenizer.json (the `tokenizers` file format); "
            "save one there (e.g. `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises plain Exceptions
        raise UserError(f"cannot load tokenizer {str(file)!r}: {e}") from None


def find_eos(tokenizer) -> int | None:
    """Id of the first of `EOS_CANDIDATES` in the tokenizer's vocabulary, or None."""
    return next((i for i in map(tokenizer.token_to_id, EOS_CANDIDATES) if i is not None), None)


def check_tokenizer_vocab(tokenizer_path: str, model_vocab_size: int) -> None:
    """Raise `UserError` if the tokenizer has more ids than the model's embedding rows."""
    n = load_tokenizer(tokenizer_path).get_vocab_size(with_added_tokens=True)
    if n > model_vocab_size:
        raise UserError(
            f"tokenizer {tokenizer_path!r} has {n} ids (with added tokens) but "
            f"model.model_config.vocab_size is {model_vocab_size}; set "
            f"model.model_config.vocab_size to at least {n}, or use the model's tokenizer"
        )
