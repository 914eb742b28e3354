"""Where Nanotron's own example configs are, and a skip for a checkout that lacks them.

They are real files from huggingface/nanotron, kept beside the repository (where
CI has them; `FIXTURES` below) and never copied into it. A clone without them still runs every other
test; the tests that read them skip with a message that says where they were looked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures" / "nanotron"

needs_fixtures = pytest.mark.skipif(
    not FIXTURES.is_dir(),
    reason=f"Nanotron's example configs are not beside this checkout (looked in {FIXTURES})",
)


def fixture_paths() -> list[Path]:
    """Every fixture config (none when the folder is absent: the tests using them skip)."""
    return sorted(FIXTURES.glob("*.yaml")) if FIXTURES.is_dir() else []
