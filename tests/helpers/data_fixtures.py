"""Data-test fixtures built locally: generated documents and a small BPE tokenizer
(`mesh3d.data.synthetic`), and a JSON Lines writer. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from mesh3d.data.synthetic import make_documents, make_tokenizer

__all__ = ["make_documents", "make_tokenizer", "write_jsonl"]


def write_jsonl(path: str | Path, docs: list[str], column: str = "text") -> Path:
    """Write `docs` as JSON Lines `{column: doc, "id": i}`."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({column: d, "id": i}) + "\n")
    return path
