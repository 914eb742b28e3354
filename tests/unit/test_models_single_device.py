"""The model files are single-device: no module under `mesh3d/models/` imports torch.distributed,
at the top or inside a function. What a family needs for tensor parallelism (its ParallelStyles)
lives in `mesh3d/tp_family_styles.py`, which its spec imports when it builds a plan."""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "mesh3d" / "models"


def distributed_imports(path: Path) -> list[str]:
    """`line: module` for each import of torch.distributed (or a name from it) in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n.startswith("torch.distributed")]
    return sorted(found)


def test_no_model_file_imports_torch_distributed():
    files = sorted(MODELS.glob("*.py"))
    assert len(files) > 10 and (MODELS / "llama.py") in files
    offenders = {p.name: hits for p in files if (hits := distributed_imports(p))}
    assert offenders == {}


def test_the_check_sees_both_forms_of_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "def f():\n    from torch.distributed.tensor import Shard\nimport torch.distributed as d\n"
    )
    assert distributed_imports(f) == ["2: torch.distributed.tensor", "3: torch.distributed"]
