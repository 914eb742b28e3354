"""The tokenizer that goes with a checkpoint: which files to copy, and where to find it again.

A save copies a local tokenizer (a file or a folder) into `<step>/tokenizer/`; a hub name is
not downloaded and nothing is copied. Nanotron ignores the extra folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from mesh3d.log import logger

FOLDER = "tokenizer"  # inside a step folder
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(name_or_path: str | Path | None) -> list[tuple[str, Path]]:
    """(name to save as, local source) of each file to copy; [] for None or a hub name."""
    if not name_or_path:
        return []
    src = Path(name_or_path)
    if src.is_file():
        return [("tokenizer.json", src)]
    if src.is_dir():
        return [(name, src / name) for name in FILES if (src / name).is_file()]
    return []  # not on this machine: a hub name


def copy_into_checkpoint(writer, name_or_path: str | None) -> None:
    """Write the local tokenizer's files to `tokenizer/` through `writer` (a `FolderWriter`).
    A file that cannot be read any more is skipped with a warning."""
    for name, src in tokenizer_files(name_or_path):
        try:
            data = src.read_bytes()
        except OSError as e:
            logger.warning(f"tokenizer file {src} not copied into the checkpoint: {e}")
            continue
        writer.write_bytes(f"{FOLDER}/{name}", data)


def copy_into_folder(name_or_path: str | Path | None, output: Path) -> list[Path]:
    """Copy the local tokenizer's files into `output` (e.g. a Hugging Face folder); the paths."""
    out = []
    for name, src in tokenizer_files(name_or_path):
        output.mkdir(parents=True, exist_ok=True)
        out.append(Path(shutil.copyfile(src, output / name)))
    return out


def step_tokenizer(step: Path) -> Path | None:
    """`<step>/tokenizer` when it holds a tokenizer.json, else None."""
    folder = step / FOLDER
    return folder if (folder / "tokenizer.json").is_file() else None


def saved_config(step: Path) -> dict:
    """`<step>/config.yaml` as plain YAML ({} when absent or unreadable): a config Nanotron
    wrote need not load in mesh3d to give its tokenizer or its unpadded vocabulary."""
    try:
        raw = yaml.safe_load((step / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def config_tokenizer(step: Path) -> str | None:
    """`tokenizer.tokenizer_name_or_path` of `<step>/config.yaml`, or None."""
    tok = saved_config(step).get("tokenizer")
    name = tok.get("tokenizer_name_or_path") if isinstance(tok, dict) else None
    return str(name) if name else None
