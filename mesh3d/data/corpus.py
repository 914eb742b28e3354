"""The default run's data, made once with no download: the standard library's source files, a
byte-level BPE tokenizer trained on them, and a Nanoset folder of their tokens, cached in
~/.cache/mesh3d/stdlib-<key>/ (or $MESH3D_CACHE). Made in a temporary folder renamed into place;
concurrent processes (ranks) take turns on a lock file, so one prepares it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from mesh3d import extensions
from mesh3d.log import logger

FORMAT = 1  # bump when what is written changes
SKIP = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def cache_root() -> Path:
    return Path(os.environ.get("MESH3D_CACHE") or Path.home() / ".cache" / "mesh3d")


def stdlib_files(budget_bytes: int) -> list[Path]:
    """The standard library's .py files in sorted order, until `budget_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts) or (size := path.stat().st_size) < 200:
            continue  # skipped folders; empty __init__ files and stubs
        files.append(path)
        total += size
        if total >= budget_bytes:
            break
    return files


def prepare_stdlib_corpus(megabytes: float = 3.0, vocab_size: int = 4096) -> Path:
    """The corpus folder, with `tokenizer/tokenizer.json` and `tokenized/*.ds`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha1(f"{FORMAT}|{sys.version}|{root}|{megabytes}|{vocab_size}".encode())
    folder = cache_root() / f"stdlib-{key.hexdigest()[:12]}"
    if (folder / "tokenized").is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _turn(folder.with_name(folder.name + ".lock")):
        if (folder / "tokenized").is_dir():  # made by the process that had the lock before
            return folder
        return _prepare(folder, root, megabytes, vocab_size)


@contextlib.contextmanager
def _turn(lock: Path):
    """Hold an exclusive lock on `lock` (released when the process ends, however it ends)."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: processes that race each make it, the first kept
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prepare(folder: Path, root: Path, megabytes: float, vocab_size: int) -> Path:
    start = time.perf_counter()
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = stdlib_files(int(megabytes * 2**20))
    logger.info(f"preparing the default run's data once: {len(files)} files of {root} -> {folder}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    with open(tmp / "text.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    from mesh3d.data.synthetic import train_bpe  # the first run's preparation only

    tokenizer = train_bpe(texts, tmp / "tokenizer", vocab_size)
    tokenize = extensions.load("tokenize")  # the first run only: the prepared data is kept
    _, docs, tokens = tokenize.tokenize_to_folder(
        str(tokenizer), [str(tmp / "text.jsonl")], str(tmp / "tokenized")
    )
    (tmp / "text.jsonl").unlink()
    try:
        os.replace(tmp, folder)
    except OSError:  # made meanwhile by another process: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        f"data ready: {docs} documents, {tokens:,} tokens in {time.perf_counter() - start:.0f} s"
    )
    return folder


def default_run_overrides() -> list[str]:
    """The overrides that point `mesh3d/configs/default.yaml` at the prepared corpus."""
    folder = prepare_stdlib_corpus()
    return [
        f"data_stages[0].data.dataset.dataset_folder=[{folder / 'tokenized'}]",
        f"tokenizer.tokenizer_name_or_path={folder / 'tokenizer'}",
    ]
