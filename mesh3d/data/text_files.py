"""Local text files read row by row for streaming (`mesh3d.data.streaming`): JSON Lines
(`.jsonl`/`.json`), parquet and arrow (`save_to_disk`'s IPC streams), resumable at any row.
Every problem is one `UserError` line naming the file (and the row where known) and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from mesh3d.errors import UserError

_SUFFIXES = {".json": "JSON Lines", ".jsonl": "JSON Lines", ".parquet": "parquet",
             ".arrow": "arrow"}  # fmt: skip


def source_files(path: str, splits: list[str]) -> list[Path]:
    """The files a source names: itself; a folder written by `save_to_disk`: its `.arrow`
    files (of `splits` for a saved `DatasetDict`); another folder: its json/jsonl/parquet/arrow
    files, in name order."""
    p = Path(path)
    if (p / "state.json").is_file():
        return sorted(p.glob("*.arrow"))
    if (p / "dataset_dict.json").is_file():
        missing = [s for s in splits if not (p / s / "state.json").is_file()]
        if missing:
            raise UserError(f"{path!r} has no split {', '.join(missing)}; set hf_dataset_splits "
                            "to splits it has")  # fmt: skip
        return [f for s in splits for f in sorted((p / s).glob("*.arrow"))]
    if p.is_file():
        if p.suffix.lower() not in _SUFFIXES:
            raise UserError(
                f"hf_dataset_or_datasets {path!r}: mesh3d.hf_streaming reads "
                f"{', '.join(_SUFFIXES)} files, not {p.suffix!r}; convert it or set "
                "mesh3d.hf_streaming: false"
            )
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _SUFFIXES)
        if files:
            return files
        raise UserError(
            f"hf_dataset_or_datasets {path!r} holds no {', '.join(_SUFFIXES)} file to stream; "
            "give a folder of such files, or set mesh3d.hf_streaming: false"
        )
    raise UserError(
        f"hf_dataset_or_datasets {path!r} is not a local file or folder; mesh3d runs offline: "
        "download it first and give the local path"
    )


def _bad(file: Path, row: int | None, what: str, fix: str) -> UserError:
    where = f"{file} row {row + 1}" if row is not None else str(file)
    return UserError(f"{where}: {what}; {fix}")


_MISSING = object()


def _text(file: Path, row: int, value, column: str, columns) -> str:
    """The text of a row's `column` value ("" for null), or the one-line error."""
    if value is _MISSING:
        raise _bad(file, row, f"no column {column!r} (it has: {', '.join(columns)})",
                   "set text_column_name to the column holding the text")  # fmt: skip
    if value is not None and not isinstance(value, str):
        raise _bad(file, row, f"column {column!r} is a {type(value).__name__}, not text",
                   "set text_column_name to a text column")  # fmt: skip
    return value or ""


def _json_rows(file: Path, column: str, start: int, mine) -> Iterator[tuple[int, str]]:
    with open(file, "rb") as f:
        for row, line in enumerate(f):
            if row < start or not line.strip():
                continue
            if not mine(row):  # another shard's row: not parsed (its shard reports it)
                yield row, ""
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise _bad(file, row, f"not valid JSON ({e})",
                           "fix or delete that line (mesh3d streams JSON Lines: one object per "
                           "line)") from None  # fmt: skip
            if not isinstance(obj, dict):
                raise _bad(file, row, "not a JSON object", "write one object per line")
            yield row, _text(file, row, obj.get(column, _MISSING), column, obj)


def _arrow_batches(file: Path, column: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if file.suffix.lower() == ".parquet":
        pf = pq.ParquetFile(file)
        names = pf.schema_arrow.names
        if column not in names:
            raise _bad(file, None, f"no column {column!r} (it has: {', '.join(names)})",
                       "set text_column_name to the column holding the text")  # fmt: skip
        yield from pf.iter_batches(batch_size=1024, columns=[column])
        return
    source = pa.memory_map(str(file))
    try:
        reader = pa.ipc.open_stream(source)  # what save_to_disk writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
        reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
    for batch in reader:
        if column not in batch.schema.names:
            raise _bad(file, None, f"no column {column!r} (it has: {', '.join(batch.schema.names)})",
                       "set text_column_name to the column holding the text")  # fmt: skip
        yield batch.select([column])


def _table_rows(file: Path, column: str, start: int, mine) -> Iterator[tuple[int, str]]:
    row = 0
    try:
        for batch in _arrow_batches(file, column):
            n = batch.num_rows
            if row + n <= start:
                row += n
                continue
            for i, value in enumerate(batch.column(0).to_pylist()):
                if row + i >= start:
                    text = _text(file, row + i, value, column, [column]) if mine(row + i) else ""
                    yield row + i, text
            row += n
    except UserError:
        raise
    except Exception as e:  # pyarrow raises several types for damaged files
        kind = _SUFFIXES[file.suffix.lower()]
        raise _bad(file, None, f"cannot be read as {kind} after row {row} "
                   f"({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                   "replace the damaged file or remove it from hf_dataset_or_datasets") from None  # fmt: skip


def read_rows(file: Path, column: str, start: int = 0, mine=None) -> Iterator[tuple[int, str]]:
    """(row index, text) of `file` from row `start` on; a row for which `mine(row)` is false is
    not checked and its text is "" (so a bad row is reported by the one shard that reads it,
    not by every dp rank)."""
    mine = mine or (lambda row: True)
    if file.suffix.lower() in (".json", ".jsonl"):
        return _json_rows(file, column, start, mine)
    return _table_rows(file, column, start, mine)


def check_file(file: Path, column: str) -> None:
    """Before training: the file is not empty and its first row has the text column."""
    if file.stat().st_size == 0:
        raise _bad(file, None, "is empty", "remove it from hf_dataset_or_datasets or fill it")
    for _ in read_rows(file, column):
        return
    raise _bad(file, None, "has no rows", "remove it from hf_dataset_or_datasets or fill it")
