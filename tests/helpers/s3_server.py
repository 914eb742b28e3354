"""A real S3 server for the upload tests, and a slowed s5cmd to keep uploads in flight.

    with moto_server() as url:                        # moto's standalone server on 127.0.0.1
        env = s3_env(url)                             # what s5cmd reads (fake credentials)
        binary = slow_s5cmd(tmp_path, delay_s=2.0)    # for `s3_upload.s5cmd_path`

The pytest fixtures `endpoint` (one server per module) and `s3` (its environment set, a fresh
bucket) are defined here; a test module imports them by name.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mesh3d.checkpoint.s3 import S5cmd, find_s5cmd

S5CMD = find_s5cmd(None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server():
    """A moto S3 server on a free port of 127.0.0.1; its URL."""
    pytest.importorskip(
        "moto.server", reason="moto[server] not installed: pip install moto[server]"
    )
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("moto server did not start")
        yield url
    finally:
        proc.kill()
        proc.wait()


def s3_env(url: str) -> dict[str, str]:
    """The variables s5cmd reads to reach the server at `url` with fake credentials."""
    return {"S3_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def make_bucket() -> str:
    """A fresh bucket on the server the environment names."""
    bucket = f"b{time.monotonic_ns()}"
    S5cmd(S5CMD).run(["mb", f"s3://{bucket}"], "cannot make", bucket)
    return bucket


def slow_s5cmd(folder: Path, delay_s: float) -> str:
    """An executable that waits `delay_s` before each s5cmd command it runs (an upload kept in
    flight); for `s3_upload.s5cmd_path`."""
    path = folder / "slow-s5cmd"
    path.write_text(f'#!/bin/sh\nsleep {delay_s}\nexec "{S5CMD}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def cat(path: str) -> str | None:
    """The text of the object `path`, None when there is none."""
    p = subprocess.run([S5CMD, "cat", path], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else None


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server on 127.0.0.1 for the module; its URL."""
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch):
    """The environment s5cmd reads (inherited by forked ranks), and a fresh bucket's name."""
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    return make_bucket()


assert os.sep == "/"  # the slowed s5cmd is a POSIX shell script
