"""Imports only point down: the import-linter contracts in pyproject.toml hold for mesh3d, and a
new upward import (function-level ones included), a model import outside models/ or an optional
capability imported by the core of a plain run breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    run = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"
    cmd = [sys.executable, "-c", run, "--config", "pyproject.toml", "--no-cache"]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_and_the_family_contract_hold():
    run = _lint(REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 kept, 0 broken" in run.stdout


def test_an_upward_function_level_import_and_a_model_import_break_the_contracts(tmp_path):
    shutil.copytree(
        REPO / "mesh3d", tmp_path / "mesh3d", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "mesh3d" / "config" / "derive.py", "a") as f:
        f.write("\n\ndef _probe():\n    from mesh3d.train import loop  # noqa: F401\n")
    with open(tmp_path / "mesh3d" / "parallel" / "data.py", "a") as f:
        f.write("\n\ndef _probe():\n    from mesh3d.models.llama import Attention  # noqa: F401\n")
    with open(tmp_path / "mesh3d" / "train" / "step.py", "a") as f:  # an optional capability
        f.write("\n\ndef _probe():\n    from mesh3d.data.sft import SFTSequences  # noqa: F401\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "mesh3d.config.derive -> mesh3d.train.loop" in run.stdout
    assert "mesh3d.parallel.data -> mesh3d.models.llama" in run.stdout
    assert "mesh3d.train.step is not allowed to import mesh3d.data.sft" in run.stdout
