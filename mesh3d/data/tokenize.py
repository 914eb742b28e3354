"""Tokenize text into datatrove's on-disk format: a folder that Nanoset reads.

    python -m mesh3d.data.tokenize --tokenizer <dir with tokenizer.json | tokenizer.json> \\
        --input <files or folders...> --output <folder> [--text-column text] \\
        [--eos-token TOKEN] [--name PREFIX] [--split train]

Inputs, read as a stream (never the whole corpus in memory), in the order given:
* `.jsonl` / `.json`: JSON Lines, one object per line; the document is its `--text-column`.
* `.txt`: one document per line (the line break is not part of it).
* `.parquet`: one document per row, from `--text-column` (needs `pyarrow`).
* a folder written by `datasets`' `save_to_disk` (needs `datasets`); for a `DatasetDict`,
  `--split` picks the split.
`.jsonl.gz`, `.json.gz` and `.txt.gz` are read through gzip. Documents with empty text are skipped.

Output, as datatrove's `DocumentTokenizer` writes it (docs/nanotron-layout.md#datatrove-token-files)
with `shuffle=False`: `<name>_00000_unshuffled.ds` (without `--name`: `00000_unshuffled.ds`) holds
the token ids, little-endian uint16, or uint32 when the tokenizer has more than 65,536 ids, no
header; `.ds.index` the uint64 end offset (in tokens) of every document; `.ds.metadata` the lines
`<tokenizer>|<bytes per token>`, the token count and a readable count. Like datatrove with an EOS
token, the tokenizer's own special tokens (e.g. BOS) are not added and EOS follows every document.
EOS is `--eos-token`, else the first of `</s>`, `<|endoftext|>`, `<|end_of_text|>`, `<eos>` the
tokenizer knows. Files are written under temporary names and renamed at the end, so a failed
or interrupted run leaves no half-written `.ds` behind. Bad input exits with code 2 and an
`error: ...` line.
"""

from __future__ import annotations

import argparse
import gzip
import io
import itertools
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from mesh3d.data.token_writer import TokenFileWriter
from mesh3d.data.tokenizer import EOS_CANDIDATES, find_eos, load_tokenizer  # noqa: F401 (re-exported)
from mesh3d.errors import UserError, exit_on_user_error

if TYPE_CHECKING:
    pass

BATCH_DOCS = 1000  # documents per encode_batch call
_TEXT_SUFFIXES = (".jsonl", ".json", ".txt")


def resolve_eos(tokenizer, eos_token: str | None) -> int:
    """Id of `eos_token`, or of the first known EOS token in the vocabulary."""
    if eos_token is not None:
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise UserError(
                f"--eos-token {eos_token!r} is not in the tokenizer's vocabulary; give a token it has"
            )
        return eos
    eos = find_eos(tokenizer)
    if eos is None:
        raise UserError(
            f"the tokenizer has none of the EOS tokens {', '.join(EOS_CANDIDATES)}; "
            "name its end-of-document token with --eos-token"
        )
    return eos


# ---------------------------------------------------------------- reading documents


def _base_suffix(path: Path) -> str:
    name = path.name.lower()
    return Path(name[:-3]).suffix if name.endswith(".gz") else path.suffix.lower()


def check_input(path: str, text_column: str) -> None:
    """Fail early (before writing anything) on an input we cannot read."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"input {path!r} does not exist")
    if p.is_dir():
        if not ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            raise UserError(
                f"input {path!r} is a folder but not a dataset saved with `datasets`' save_to_disk "
                "(no state.json or dataset_dict.json); give the data files inside it instead"
            )
        _require("datasets", f"input {path!r} is a saved `datasets` folder")
        return
    suffix = _base_suffix(p)
    if suffix == ".parquet":
        _require("pyarrow", f"input {path!r} is a parquet file")
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise UserError(f"input {path!r} is not a readable parquet file ({e})") from None
        if text_column not in names:
            raise UserError(_missing_column(path, text_column, names))
    elif suffix not in _TEXT_SUFFIXES:
        raise UserError(
            f"input {path!r}: unsupported file type {suffix or '(none)'!r}; use .jsonl/.json "
            "(JSON Lines), .txt (one document per line), .parquet, or a save_to_disk folder"
        )


def _require(module: str, why: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise UserError(f"{why}, which needs `{module}`: pip install {module}") from None


def _missing_column(where: str, column: str, available: Iterable[str]) -> str:
    return (
        f"{where} has no column {column!r} (it has: {', '.join(map(str, available)) or 'none'}); "
        "name the text column with --text-column"
    )


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl_texts(path: Path, column: str) -> Iterator[str]:
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{n} is not valid JSON ({e.msg}); .json/.jsonl inputs are read as "
                    "JSON Lines, one object per line"
                ) from None
            if not isinstance(row, dict) or column not in row:
                keys = row.keys() if isinstance(row, dict) else []
                raise UserError(_missing_column(f"{path}:{n}", column, keys))
            text = row[column]
            if not isinstance(text, str):
                raise UserError(
                    f"{path}:{n}: column {column!r} is {type(text).__name__}, not text; fix the "
                    "row or name another column with --text-column"
                )
            yield text


def _txt_texts(path: Path) -> Iterator[str]:
    with _open_text(path) as f:
        for line in f:
            yield line.rstrip("\r\n")


def _parquet_texts(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_DOCS, columns=[column]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def _saved_dataset_texts(path: Path, column: str, split: str) -> Iterator[str]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(
                f"{path} has splits {', '.join(ds)}, not {split!r}; pick one with --split"
            )
        ds = ds[split]
    if column not in ds.column_names:
        raise UserError(_missing_column(str(path), column, ds.column_names))
    for batch in ds.select_columns([column]).iter(batch_size=BATCH_DOCS):
        yield from (t for t in batch[column] if t is not None)


def iter_documents(paths: Iterable[str], text_column: str, split: str = "train") -> Iterator[str]:
    """The non-empty documents of all inputs, in order (see the module docstring)."""
    for path in map(Path, paths):
        if path.is_dir():
            texts = _saved_dataset_texts(path, text_column, split)
        elif _base_suffix(path) == ".parquet":
            texts = _parquet_texts(path, text_column)
        elif _base_suffix(path) == ".txt":
            texts = _txt_texts(path)
        else:
            texts = _jsonl_texts(path, text_column)
        try:
            yield from (t for t in texts if t)
        except UnicodeDecodeError as e:
            raise UserError(f"input {str(path)!r} is not UTF-8 text ({e})") from None


class _Progress:
    """tqdm on a terminal's stderr when available, else a line every 30 seconds."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.bar = None
        try:
            from tqdm import tqdm

            self.bar = tqdm(unit=" docs", file=sys.stderr, disable=None, dynamic_ncols=True)
        except ImportError:
            pass

    def update(self, documents: int, total_docs: int, total_tokens: int) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.update(documents)
            self.bar.set_postfix(tokens=total_tokens, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= 30:
            self.last = now
            rate = total_tokens / (now - self.start)
            print(
                f"tokenize: {total_docs} documents, {total_tokens} tokens, {rate:,.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tokenize_to_folder(
    tokenizer_path: str,
    inputs: list[str],
    output: str,
    *,
    text_column: str = "text",
    eos_token: str | None = None,
    name: str | None = None,
    split: str = "train",
) -> tuple[Path, int, int]:
    """Tokenize `inputs` into `output/<name>_00000_unshuffled.ds` (+ .index, .metadata).

    Returns (the .ds path, documents, tokens). Raises `UserError` on bad input, before writing
    when it can (missing files, unsupported types, a parquet file without the column); other
    errors found while streaming delete the partial output.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    eos = resolve_eos(tokenizer, eos_token)
    for path in inputs:
        check_input(path, text_column)
    os.makedirs(output, exist_ok=True)
    ds_path = Path(output) / "_".join(x for x in (name, "00000_unshuffled.ds") if x)
    progress = _Progress()
    docs = iter_documents(inputs, text_column, split)
    try:
        with TokenFileWriter(
            ds_path, str(Path(tokenizer_path).resolve()), tokenizer.get_vocab_size(), eos
        ) as writer:
            while batch := list(itertools.islice(docs, BATCH_DOCS)):
                encoded = tokenizer.encode_batch(batch, add_special_tokens=False)
                writer.add([e.ids for e in encoded])
                progress.update(len(batch), writer.documents, writer.tokens)
            if writer.documents == 0:
                raise UserError(f"no documents in {', '.join(inputs)} (all empty); nothing written")
    finally:
        progress.close()
    return ds_path, writer.documents, writer.tokens


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mesh3d.data.tokenize",
        description="Tokenize text into datatrove's .ds format (a folder for Nanoset's "
        "dataset_folder). EOS follows every document.",
    )
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json, or the file")
    ap.add_argument(
        "--input",
        required=True,
        nargs="+",
        help=".jsonl/.json (JSON Lines), .txt (one document per line), .parquet, or a "
        "save_to_disk folder",
    )
    ap.add_argument("--output", required=True, help="output folder (created if needed)")
    ap.add_argument("--text-column", default="text", help="column holding the text (default text)")
    ap.add_argument("--eos-token", help="end-of-document token (default: </s>, <|endoftext|>, ...)")
    ap.add_argument("--name", help="file name prefix: <name>_00000_unshuffled.ds")
    ap.add_argument("--split", default="train", help="split of a saved DatasetDict (default train)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    ds_path, documents, tokens = tokenize_to_folder(
        args.tokenizer,
        args.input,
        args.output,
        text_column=args.text_column,
        eos_token=args.eos_token,
        name=args.name,
        split=args.split,
    )
    seconds = time.perf_counter() - start
    print(
        f"wrote {ds_path}: {documents} documents, {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
