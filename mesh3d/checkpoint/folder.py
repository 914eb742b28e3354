"""Atomic, checksummed checkpoint folders: how every checkpoint reaches the disk.

A save writes into `<root>/.tmp-<name>/` through `FolderWriter`s (each file fsynced, its size
and CRC-32 recorded). Rank 0 writes `mesh3d_manifest.json` last and `commit`s:
  1. an existing `<name>/` is renamed to `.old-<name>/` (never deleted first);
  2. `.tmp-<name>/` is renamed to `<name>/` and the root fsynced;
  3. `latest.txt` is replaced atomically;
  4. `.old-<name>/` is removed.
`recover` puts back an `.old-<name>/` left without `<name>/` by a crash and removes other
leftovers. `config.yaml` and `checkpoint_metadata.json` stay out of the manifest: people edit
them, and their fields are checked when read. CRC-32 detects corruption, not tampering.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import zlib
from pathlib import Path

from mesh3d.errors import CheckpointWriteError, UserError
from mesh3d.log import logger

MANIFEST = "mesh3d_manifest.json"
LATEST = "latest.txt"
UNCHECKED = frozenset({"config.yaml", "checkpoint_metadata.json", MANIFEST})
_CHUNK = 16 * 2**20
HEADER_BYTES = 4096  # per file, at most: safetensors metadata, torch's zip records


def gib(n: float) -> str:
    """`n` bytes for a message: GiB, or MiB / KiB when smaller."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def crc32_of(path: Path) -> tuple[int, int]:
    """(bytes, CRC-32) of the file at `path`."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable; a no-op where not supported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def write_error(path: Path, e: OSError, root: Path | None = None) -> CheckpointWriteError:
    """A `CheckpointWriteError` for `e` raised while writing `path`, with the free space."""
    where = root or path.parent
    try:
        free = f"{gib(shutil.disk_usage(where).free)} free on {where}"
    except OSError:
        free = "free space unknown"
    what = "no space left on the device" if e.errno == errno.ENOSPC else e.strerror or str(e)
    return CheckpointWriteError(
        f"cannot write {path}: {what} (errno {e.errno}; {free}); free space or point "
        "checkpoints.checkpoints_path at another disk"
    )


class _HashingFile(io.RawIOBase):
    """A write-only file keeping the CRC-32 and size of what it wrote, and a write's `OSError`:
    torch's zip writer replaces that with a RuntimeError ("unexpected pos")."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        try:
            return self.f.write(view)
        except OSError as e:
            self.error = e
            raise


class FolderWriter:
    """Writes the files of one checkpoint folder and records (bytes, CRC-32) of each.

    Example:

        w = FolderWriter(Path("ckpt/.tmp-10"))
        w.write_text("model_config.json", "{}")
        w.files   # {"model_config.json": (2, 2745614147)}
    """

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[str, tuple[int, int]] = {}
        self._dirs: set[Path] = set()

    def _write(self, rel: str, fill) -> None:
        path, f = self.folder / rel, None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
            with open(path, "wb") as raw:
                f = _HashingFile(raw)
                fill(f)
                raw.flush()
                os.fsync(raw.fileno())
        except OSError as e:
            raise write_error(path, e, self.folder.parent) from None
        except Exception:
            if f is None or f.error is None:
                raise
            raise write_error(path, f.error, self.folder.parent) from None  # inside torch.save
        self.files[rel] = (f.size, f.crc)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._write(rel, lambda f: f.write(data))

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def save_tensors(self, rel: str, tensors: dict, metadata: dict | None = None) -> None:
        """A safetensors file (`tensors` must be contiguous CPU tensors)."""
        from safetensors.torch import save

        self.write_bytes(rel, save(tensors, metadata=metadata or None))

    def save_torch(self, rel: str, obj) -> None:
        """`torch.save(obj)` streamed through the checksum."""
        import torch

        self._write(rel, lambda f: torch.save(obj, f))

    def sync_dirs(self) -> None:
        """fsync every folder this writer created files in."""
        for d in sorted(self._dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)


def write_manifest(folder: Path, files: dict[str, tuple[int, int]]) -> None:
    """`mesh3d_manifest.json`: every checked file's bytes and CRC-32, written and fsynced."""
    body = {
        "format": "mesh3d-manifest/1",
        "algorithm": "crc32",
        "files": {
            rel: {"bytes": size, "crc32": f"{crc:08x}"}
            for rel, (size, crc) in sorted(files.items())
            if rel not in UNCHECKED
        },
    }
    FolderWriter(folder).write_text(MANIFEST, json.dumps(body, indent=1))


def read_manifest(step_dir: Path) -> dict[str, dict] | None:
    """The manifest's files (None for a folder written without one, e.g. by Nanotron)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {
            rel: {"bytes": int(v["bytes"]), "crc32": str(v["crc32"])} for rel, v in files.items()
        }
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is damaged ({e!r}); the checkpoint cannot be verified") from None


def verify(step_dir: Path, rank: int = 0, world: int = 1, skip: tuple[str, ...] = ()) -> list[str]:
    """Problems with this rank's share of the manifest's files (every `world`-th from `rank`;
    none under the folders `skip` names: not read), one message each; [] when all match or
    there is no manifest."""
    problems, files = [], read_manifest(step_dir) or {}
    for rel, want in sorted(x for x in files.items() if not x[0].startswith(skip))[rank::world]:
        path = step_dir / rel
        if not path.is_file():
            problems.append(f"{path} is missing (listed in {MANIFEST})")
            continue
        size, crc = crc32_of(path)
        if size != want["bytes"]:
            problems.append(f"{path} has {size} bytes, {MANIFEST} says {want['bytes']}")
        elif f"{crc:08x}" != want["crc32"]:
            problems.append(f"{path} is damaged: CRC-32 {crc:08x}, {MANIFEST} says {want['crc32']}")
    return problems


def damaged_error(step_dir: Path, problems: list[str]) -> UserError:
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    shown = "; ".join(problems[:5]) + more
    return UserError(
        f"checkpoint {step_dir} failed verification: {shown}. Restore the file(s) from a copy, "
        f"or use another step folder of {step_dir.resolve().parent}"
    )


def commit(tmp: Path, final: Path, latest: bool = True) -> None:
    """Put `tmp` in place as `final` (module doc); name it in `latest.txt` when `latest`."""
    root = final.parent
    fsync_dir(tmp)
    old = root / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    if latest:
        write_latest(root, final.name)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(root: Path, name: str) -> None:
    """Replace `<root>/latest.txt` atomically and durably."""
    tmp = root / f".{LATEST}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    except OSError as e:
        raise write_error(root / LATEST, e) from None
    fsync_dir(root)


def step_folders(root: Path) -> list[int]:
    """The complete step folders of a checkpoints folder (those with checkpoint metadata)."""
    if not root.is_dir():
        return []
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir()]
    return sorted(s for s in steps if (root / str(s) / "checkpoint_metadata.json").is_file())


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: `config.json` and safetensors, no Nanotron `model/`."""
    return (path / "config.json").is_file() and not (path / "model").is_dir()


def latest_step(root: Path) -> int | None:
    """The step `latest.txt` names, if it names a complete folder."""
    path = root / LATEST
    try:
        step = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return step if (root / str(step) / "checkpoint_metadata.json").is_file() else None


def recover(root: Path) -> list[str]:
    """Finish or undo what an interrupted save left in `root`; what was done, one line each."""
    done = []  # (globbing a missing folder finds nothing)
    for old in sorted(root.glob(".old-*")):
        final = root / old.name.removeprefix(".old-")
        if not final.exists() and (old / "checkpoint_metadata.json").is_file():
            os.replace(old, final)
            done.append(f"restored {final} from {old.name} (a save replacing it was interrupted)")
        else:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old} (left by an interrupted save)")
    for tmp in sorted(root.glob(".tmp-*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the incomplete {tmp} (left by an interrupted save)")
    if done:
        fsync_dir(root)
    for line in done:
        logger.warning(line)
    return done


def on_disk(root: Path, data: int, files: int) -> int:
    """About what `data` bytes in `files` files and folders take on the disk of `root`: each
    may use one more block (4 KiB where unknown) and `HEADER_BYTES` of headers."""
    try:
        block = os.statvfs(root).f_frsize or 4096
    except (OSError, AttributeError):
        block = 4096
    return data + files * (block + HEADER_BYTES)


def check_free_space(root: Path, needed: int, step: int, files: int = 0) -> None:
    """Refuse a save of `needed` bytes in `files` files and folders (`on_disk`) that cannot fit."""
    needed = on_disk(root, needed, files)
    free = shutil.disk_usage(root).free
    if free < needed:
        kept = "no checkpoint was written yet"
        if last := latest_step(root):
            kept = f"the last complete checkpoint is {root / str(last)}"
        raise CheckpointWriteError(
            f"not enough space for the checkpoint of step {step} in {root}: it needs about "
            f"{gib(needed)}, {gib(free)} are free; {kept}. Free space or point "
            "checkpoints.checkpoints_path at another disk"
        )
