"""mesh3d as a library: the public names, a model of the user's own (not Llama) in 3D, a Hugging
Face `LlamaForCausalLM` under mesh3d's TP + DP, and `save_state` / `load_state` across layouts.

This file holds the tests of that subject that launch real processes; the others are in
`tests/ranks/test_library.py`."""

from __future__ import annotations

import subprocess
import sys


def test_help_lists_the_public_api():
    out = subprocess.run(
        [sys.executable, "-c", "import mesh3d; help(mesh3d)"],
        capture_output=True, text=True, timeout=120, env={"PAGER": "cat", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for name in ("build_stage", "apply_tp", "save_state", "normalized_loss", "Nanoset"):
        assert name in out.stdout
