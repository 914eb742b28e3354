"""The rows of an SFT dataset, checked as they are read (`mesh3d.data.sft`): a prompt or
completion that is not text, or bytes that are not UTF-8, is one `UserError` line naming the
row (from 1) and the fix, never a traceback from the tokenizer or pyarrow."""

from __future__ import annotations

import json

from mesh3d.errors import UserError


def text_of(value, column: str, row: int, where: str) -> str:
    """A row's prompt or completion: text ("" for null), or one line naming the row."""
    if value is None or isinstance(value, str):
        return value or ""
    raise UserError(
        f"{where}: row {row + 1}: {column!r} is {type(value).__name__} {value!r}, not text; "
        "fix that row (prompt and completion are strings)"
    )


def check_text_column(rows, column: str, where: str) -> None:
    """One line naming the first row whose `column` is not text. A loader reads a column holding
    any non-string as non-text: numbers only as numbers, a mix as `Json` (each value's JSON
    text underneath, whose decoding would turn a string " 3" into 3)."""
    feature = rows.features.get(column)
    if getattr(feature, "dtype", None) in ("string", "large_string", "null"):
        return
    raw = rows.with_format("arrow")[column].to_pylist()
    if type(feature).__name__ == "Json":
        raw = [None if r is None else json.loads(r) for r in raw]
    for i, value in enumerate(raw):
        text_of(value, column, i, where)


def undecodable(rows, where: str, error: UnicodeDecodeError) -> UserError:
    """The one line for rows holding bytes that are not UTF-8, naming the first such row."""
    row = next((i for i in range(len(rows)) if not _decodes(rows, i)), None)
    at = f"row {row + 1}" if row is not None else "a row"
    return UserError(
        f"{where}: {at} holds bytes that are not UTF-8 text ({error.reason} at byte "
        f"{error.start}); fix or delete that row (save the file as UTF-8)"
    )


def _decodes(rows, i: int) -> bool:
    try:
        rows[i]
    except UnicodeDecodeError:
        return False
    return True
