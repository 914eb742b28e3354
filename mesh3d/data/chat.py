"""Chat data (a `messages` column) for SFT: not implemented yet; refused with one line."""

from __future__ import annotations

from mesh3d.errors import UserError


def render_messages(rows, tokenizer_path: str, where: str):
    raise UserError(
        f"{where}: a 'messages' column (chat data) is not supported by mesh3d yet; give "
        "'prompt' and 'completion' columns instead"
    )
