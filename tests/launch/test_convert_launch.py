"""`python -m mesh3d.convert`: HF Llama <-> Nanotron layout, bitwise round trip, logits parity
of mesh3d's Llama on converted weights, the interleaved-rotary permutation, CLI errors.

This file holds the tests of that subject that launch real processes; the others are in
`tests/unit/test_convert.py`."""

import subprocess
import sys


def test_cli_missing_folder_exits_2(tmp_path):
    missing = tmp_path / "nope"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mesh3d.convert",
            "from-hf",
            "--model",
            str(missing),
            "--output",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "error:" in r.stderr and str(missing) in r.stderr and "does not exist" in r.stderr
