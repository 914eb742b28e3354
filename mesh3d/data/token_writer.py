"""Writing datatrove's tokenized files (`data/datatrove.py` reads them and states the format).

Used by the tools that prepare data (`data/tokenize.py`, `mesh3d tokenize`, the DoReMi domain
folders); a training run only reads. Writing is atomic: temporary files renamed into place, the
`.ds` last, so a reader never globs a half-written file.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np

from mesh3d.data.datatrove import TOKEN_DTYPES, token_size_for_vocab


def token_dtype(vocab_size: int) -> np.dtype:
    """datatrove's token type: little-endian uint32 above 65,536 ids, else uint16."""
    return TOKEN_DTYPES[token_size_for_vocab(vocab_size)]


def readable_count(n: int) -> str:
    """`1234567` -> `1.23 MT`, like datatrove's third metadata line."""
    for value, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= value:
            return f"{n / value:.2f} {prefix}T"
    return f"{n} T"


class TokenFileWriter:
    """Writes one datatrove `.ds` file with its `.ds.index` and `.ds.metadata`, atomically.

    Use as a context manager: `add(documents)` appends tokenized documents, each followed by
    `eos`; a clean exit renames the temporary files into place, an exception deletes them.
    """

    def __init__(self, ds_path: str | os.PathLike, tokenizer_name: str, vocab_size: int, eos: int):
        self.ds_path = Path(ds_path)
        self.tokenizer_name, self.eos = tokenizer_name, eos
        self.dtype = token_dtype(vocab_size)
        self.paths = {s: Path(f"{self.ds_path}{s}") for s in ("", ".index", ".metadata")}
        self.temps = {s: p.with_name(f".{p.name}.tmp{os.getpid()}") for s, p in self.paths.items()}
        self.documents = self.tokens = 0

    def __enter__(self) -> TokenFileWriter:
        self._ds = open(self.temps[""], "wb")
        self._index = open(self.temps[".index"], "wb")
        return self

    def add(self, documents: list[list[int]]) -> None:
        """Append documents (token id lists); EOS is written after each."""
        if not documents:
            return
        lengths = np.fromiter((len(d) + 1 for d in documents), np.int64, len(documents))
        ends = np.cumsum(lengths)
        flat = np.empty(int(ends[-1]), dtype=self.dtype)
        is_text = np.ones(len(flat), dtype=bool)
        is_text[ends - 1] = False
        flat[~is_text] = self.eos
        flat[is_text] = np.fromiter(
            itertools.chain.from_iterable(documents), np.int64, len(flat) - len(documents)
        )
        self._ds.write(flat.data)
        self._index.write((ends + self.tokens).astype("<u8").data)
        self.documents += len(documents)
        self.tokens += len(flat)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ds.close()
        self._index.close()
        if exc_type is None:
            self.temps[".metadata"].write_text(
                f"{self.tokenizer_name}|{self.dtype.itemsize}\n{self.tokens}\n"
                f"{readable_count(self.tokens)}",
                encoding="utf-8",
            )
            for suffix in (".index", ".metadata", ""):  # the .ds last: readers glob *.ds
                os.replace(self.temps[suffix], self.paths[suffix])
        else:
            for p in self.temps.values():
                p.unlink(missing_ok=True)
