"""Data: the tokenize tool, Nanoset (datatrove folders, blending, epochs), the HF datasets path.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_data.py`."""

import subprocess
import sys
from pathlib import Path

import test_data
from data_fixtures import write_jsonl

# test_data's fixtures, requested here by name
docs, tok_path = test_data.docs, test_data.tok_path

REPO = Path(__file__).resolve().parents[2]


def test_tool_cli_exit_codes(tmp_path, tok_path, docs):
    good = write_jsonl(tmp_path / "d.jsonl", docs[:20])
    cmd = [sys.executable, "-m", "mesh3d.data.tokenize", "--tokenizer", str(tok_path.parent)]
    out = ["--output", str(tmp_path / "out")]
    r = subprocess.run([*cmd, "--input", str(good), *out], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "20 documents" in r.stdout and "tokens/s" in r.stdout
    r = subprocess.run(
        [*cmd, "--input", str(tmp_path / "nope.jsonl"), *out],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2
    assert "error: input" in r.stderr and "nope.jsonl" in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr
