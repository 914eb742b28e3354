"""The README's first commands, verbatim, in a clean clone without Nanotron's fixture configs beside
it: the install line, the default training run, and the test command (collection: running the whole
suite inside itself would recurse), in a fresh virtual environment that sees this one's packages
(torch is not downloaded again).

The tests of this subject that launch real processes are in `tests/launch/test_readme_launch.py`."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def first_commands() -> list[str]:
    """The commands of the README's first two bash blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)[:2]
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_first_commands_are_install_test_train():
    assert first_commands() == ['pip install "torch==2.13.0" -e ".[dev]"', "python -m pytest -q",
                                "mesh3d train"]  # fmt: skip
