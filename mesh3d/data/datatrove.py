"""Reading datatrove's tokenized files (docs/nanotron-layout.md#datatrove-token-files), the format
Nanotron's Nanoset reads: raw token ids with `.ds.index` and `.ds.metadata` beside them. Files are
memory-mapped. Writing is `data/token_writer.py`'s.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from mesh3d.errors import UserError
from mesh3d.log import Progress

DATATROVE_FILE_SEED = 42  # datatrove's default seed for the file-level shuffle
TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SCAN_TOKENS = 1 << 22  # tokens per block when scanning a file for out-of-vocabulary ids


def token_size_for_vocab(vocab_size: int) -> int:
    """Bytes per token datatrove uses for a vocabulary: 4 above 65,536 entries, else 2."""
    return 4 if vocab_size > 65536 else 2


def metadata_token_size(ds_path: str | os.PathLike) -> int | None:
    """Token size from `<file>.ds.metadata` line 1 (`<tokenizer>|<bytes>`), or None if absent
    (older datatrove versions write only the tokenizer name)."""
    meta = Path(f"{ds_path}.metadata")
    if not meta.is_file():
        return None
    first = meta.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip()
    if "|" not in first:
        return None
    size = first.rsplit("|", 1)[1].strip()
    if size not in ("2", "4"):
        raise UserError(
            f"{meta}: line 1 is {first!r}; expected '<tokenizer>|2' or '<tokenizer>|4' (bytes per "
            "token). Fix or delete the metadata file and set token_size_in_bytes instead"
        )
    return int(size)


class WindowSource(Protocol):
    """What `BlendedSamples` blends: a list of token windows of S+1 tokens each."""

    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray: ...


class DatatroveFile:
    """One `.ds` file: `len(f)` samples, `f.window(i)` -> the (S+1,) token window i (a memmap view).

    `max_tokens` caps the tokens the samples are cut from, as datatrove's `DatatroveFileDataset`.
    """

    def __init__(
        self, path: str | os.PathLike, seq_len: int, token_size: int, max_tokens: int | None = None
    ):
        self.path, self.seq_len, self.token_size = str(path), seq_len, token_size
        self.dtype = TOKEN_DTYPES[token_size]
        size = os.path.getsize(self.path)
        if size == 0:
            raise UserError(
                f"{self.path} is empty (0 bytes); delete it (and its .index/.metadata) or "
                "tokenize its data again"
            )
        if size % token_size:
            raise UserError(
                f"{self.path} has {size} bytes, not a multiple of the token size "
                f"({token_size} bytes, {self.dtype.name}): the file is truncated, or the token size "
                "is wrong. Tokenize its data again, or fix token_size_in_bytes / the .ds.metadata"
            )
        self.num_tokens = size // token_size
        self.used_tokens = min(max_tokens, self.num_tokens) if max_tokens else self.num_tokens
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        """All token ids of the file, memory-mapped read-only (opened on first use)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self.used_tokens // (self.seq_len + 1)

    def window(self, index: int) -> np.ndarray:
        w = self.seq_len + 1
        return self.tokens[index * w : (index + 1) * w]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `UserError` at the first token id >= `vocab_size` (scans the file in blocks)."""
        if self.dtype.itemsize == 2 and vocab_size > 65535:
            return  # every uint16 id fits
        # read in blocks rather than through the memmap: the scan leaves no mapped pages behind
        with open(self.path, "rb") as f:
            for start in range(0, self.num_tokens, _SCAN_TOKENS):  # noqa: B007 (used below)
                block = np.fromfile(f, dtype=self.dtype, count=_SCAN_TOKENS)
                if int(block.max()) >= vocab_size:
                    break
            else:
                return
        offset = int(np.argmax(block >= vocab_size))
        value = int(block[offset])
        raise UserError(
            f"{self.path}: token {start + offset} is id {value}, but the model's vocabulary "
            f"has {vocab_size} ids (model.model_config.vocab_size). The folder was tokenized "
            "with a different (larger) tokenizer: tokenize it again with the model's "
            f"tokenizer, or set model.model_config.vocab_size to at least {value + 1}"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # reopen the memmap after pickling, do not copy the tokens
        return state


class DatatroveFolder:
    """A folder of `.ds` files read as datatrove does: sorted, shuffled with seed 42, concatenated.

    A file's token size comes from its `.ds.metadata`, else `token_size_in_bytes`, else
    `vocab_size`. `read_path` (`dataset_read_path`): a local copy, read from for the files it has
    (and listed when `folder` is remote). `max_tokens` (`dataset_max_tokens`): the sorted files
    are taken in turn, each capped at the tokens still allowed, before the shuffle.
    """

    def __init__(self, folder: str | os.PathLike, seq_len: int, *, vocab_size: int | None = None,
                 token_size_in_bytes: int | None = None, check_token_ids: bool = True,
                 file_seed: int = DATATROVE_FILE_SEED, read_path: str | os.PathLike | None = None,
                 max_tokens: int | None = None):  # fmt: skip
        self.folder, self.seq_len = str(folder), seq_len
        self.read_path = None if read_path is None else str(read_path)
        listed = self.folder
        if not os.path.isdir(self.folder) and self.read_path and os.path.isdir(self.read_path):
            listed = self.read_path  # a remote folder: its local copy lists the files
        if not os.path.exists(listed):
            hint = ("`python recipes/tiny_data.py` writes it" if "tiny_data" in self.folder
                    else "`mesh3d.data.tokenize` writes one from text")  # fmt: skip
            copy = f" and dataset_read_path {self.read_path!r}" if self.read_path else ""
            raise UserError(
                f"dataset_folder {self.folder!r}{copy} does not exist; fix the path ({hint})"
            )
        if not os.path.isdir(listed):
            raise UserError(
                f"dataset_folder {listed!r} is a file; give the folder that holds the .ds files"
            )
        if token_size_in_bytes is not None and token_size_in_bytes not in TOKEN_DTYPES:
            raise UserError(f"token_size_in_bytes is {token_size_in_bytes}; use 2 or 4")
        names = sorted(p.name for p in Path(listed).glob("*.ds") if p.is_file())
        if not names:
            raise UserError(
                f"dataset_folder {listed!r} has no *.ds files (datatrove's tokenized output). "
                "Tokenize text into it with `python -m mesh3d.data.tokenize --tokenizer <dir> "
                f"--input <files> --output {listed}`"
            )
        kept, left = [], max_tokens
        for name in names:
            kept.append(self._open(self._where(name), vocab_size, token_size_in_bytes, left))
            if left is not None:
                left -= len(kept[-1]) * (seq_len + 1)
                if left <= 0:
                    break
        order = np.random.default_rng(file_seed).permutation(len(kept))
        self.files = [kept[i] for i in order]
        self.starts = [0, *np.cumsum([len(f) for f in self.files]).tolist()]  # file f starts at [f]
        if len(self) == 0 and max_tokens is not None:
            raise UserError(
                f"dataset_max_tokens {max_tokens} of dataset_folder {self.folder!r} is less than "
                f"one sample ({seq_len + 1} tokens: tokens.sequence_length + 1); raise it"
            )
        if len(self) == 0:
            tokens = sum(f.num_tokens for f in self.files)
            raise UserError(
                f"dataset_folder {self.folder!r} has {tokens} tokens in {len(names)} files, and "
                f"no file has the {seq_len + 1} tokens (tokens.sequence_length + 1) of one sample; "
                "add data or lower tokens.sequence_length"
            )
        if check_token_ids and vocab_size is not None:
            progress = Progress(f"Checking token ids in {self.folder}", len(self.files))
            for f in self.files:
                f.check_vocab(vocab_size)
                progress.update()
            progress.done(f" ({sum(f.num_tokens for f in self.files):,} tokens)")

    def _where(self, name: str) -> str:
        """Where file `name` is read: the local copy when it has it, else the folder."""
        there = os.path.join(self.folder, name)
        if self.read_path:
            local = os.path.join(self.read_path, name)
            if os.path.isfile(local):
                if os.path.isfile(there) and os.path.getsize(there) != os.path.getsize(local):
                    raise UserError(
                        f"{local} has {os.path.getsize(local)} bytes but {there} has "
                        f"{os.path.getsize(there)}: the local copy (dataset_read_path) is "
                        "incomplete or stale; copy the file again or delete it"
                    )
                return local
        return there

    def _open(
        self, path: str, vocab_size: int | None, explicit: int | None, max_tokens: int | None
    ) -> DatatroveFile:
        size = metadata_token_size(path)
        if size is not None and explicit is not None and size != explicit:
            raise UserError(
                f"{path}.metadata says {size} bytes per token but token_size_in_bytes is "
                f"{explicit}; remove token_size_in_bytes or set it to {size}"
            )
        size = explicit if size is None else size
        if size is None:
            if vocab_size is None:
                raise UserError(
                    f"cannot tell the token size of {path}: it has no .ds.metadata; set "
                    "token_size_in_bytes (2 or 4)"
                )
            size = token_size_for_vocab(vocab_size)
        return DatatroveFile(path, self.seq_len, size, max_tokens)

    def __len__(self) -> int:
        return self.starts[-1]

    def window(self, index: int) -> np.ndarray:
        """Sample `index` of the folder: the (S+1,) token window, from the file that holds it."""
        f = bisect.bisect_right(self.starts, index) - 1
        return self.files[f].window(index - self.starts[f])
