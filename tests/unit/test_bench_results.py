"""Benchmarks write to a folder git ignores unless asked to publish (benchmarks/_results.py).

- Every entry point in benchmarks/ takes `--publish` and picks its folder through the helper.
- The default folder is ignored by git; `--publish` is the tracked benchmarks/results/.
- End to end: a tiny `doc_masking.py` run writes to the local folder, and with `--publish` to the
  published one (both moved to a temporary folder here).

The tests of this subject that launch real processes are in
`tests/launch/test_bench_results_launch.py`."""

import ast
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
# scripts, and packages (a benchmark of several files) by their __main__.py
ENTRY_POINTS = sorted(
    [p for p in BENCH.glob("*.py") if not p.name.startswith("_")]
    + list(BENCH.glob("*/__main__.py"))
)


def _name(path: Path) -> str:
    return path.parent.name if path.name == "__main__.py" else path.stem


def _load(name: str):
    if str(BENCH) not in sys.path:  # as when a script runs: its folder is on sys.path
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_uses_the_helper():
    assert {_name(p) for p in ENTRY_POINTS} >= {
        "throughput", "schedules", "checkpoint_io", "data_io", "zero_memory", "gpu",
        "guard_overhead", "doc_masking",
    }  # fmt: skip
    for path in ENTRY_POINTS:
        tree = ast.parse(path.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "_results"
            for alias in node.names
        }
        assert imported - {"print_header"} == {"add_publish_flag", "results_dir"}, _name(path)
        text = path.read_text()
        assert '"benchmarks/results' not in text and '"results"' not in text, _name(path)


def test_doc_masking_writes_locally_unless_published(tmp_path, monkeypatch):
    results = _load("_results")
    monkeypatch.setattr(results, "LOCAL", tmp_path / "local")
    monkeypatch.setattr(results, "PUBLISHED", tmp_path / "published")
    monkeypatch.setitem(sys.modules, "_results", results)  # the module the script imports
    bench = _load("doc_masking")
    args = ["--seq", "32", "--batch", "1", "--doc", "8", "--rounds", "2"]
    assert bench.main(args) == 0
    assert json.loads((tmp_path / "local" / "doc_masking.json").read_text())["seq"] == 32
    assert not (tmp_path / "published").exists()
    assert bench.main([*args, "--publish"]) == 0
    assert (tmp_path / "published" / "doc_masking.json").exists()
