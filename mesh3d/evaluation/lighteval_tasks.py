"""lighteval's tasks without its whole registry: only the requested built-in tasks and the
custom-task file are imported, so `mesh3d eval --engine lighteval` needs no network.

lighteval 0.13's `Registry` imports every built-in task module to find any one of them; one of
them (`tiny_benchmarks`) downloads a file at import and another (`mt_bench`) calls the Hub
client with an argument `huggingface_hub` 1.x no longer takes, so it fails offline and with the
hub client transformers 5 needs. Here each built-in module's source is read (not run) for the
names it gives `LightevalTaskConfig(name=...)` (or a subclass's `super().__init__(name=...)`: a literal, an f-string's leading text, or a
variable assigned either), the modules holding the requested names are imported, and a
`Registry` is made of their `TASKS_TABLE`s and the custom file's. Task strings are lighteval's
(`task`, `task|shots`, `suite|task|shots`) or Nanotron's (`suite|task|shots|truncate`): the suite
and the truncate flag are dropped as lighteval 0.13 drops them.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import importlib.util
from pathlib import Path

from mesh3d.errors import UserError


def _lighteval():
    try:
        import lighteval  # noqa: F401
    except ImportError:
        raise UserError(
            "mesh3d eval --engine lighteval needs lighteval: pip install 'mesh3d[lighteval]' "
            "(or pip install lighteval==0.13.0)"
        ) from None


def task_specs(tasks: str, num_fewshot: int | None = None) -> list[tuple[str, int]]:
    """[(task name, few-shot count)] of a comma-separated task string in lighteval's or
    Nanotron's syntax; `num_fewshot` replaces every count."""
    out = []
    for spec in (s.strip() for s in tasks.split(",")):
        if not spec:
            continue
        parts = spec.split("|")
        if len(parts) > 4:
            raise UserError(f"--tasks: {spec!r} is not task, task|shots, suite|task|shots or "
                            "suite|task|shots|truncate")  # fmt: skip
        name = parts[1] if len(parts) >= 3 else parts[0]
        shots = parts[2] if len(parts) >= 3 else (parts[1] if len(parts) == 2 else "0")
        if not shots.isdigit():
            raise UserError(f"--tasks: the few-shot count of {spec!r} is {shots!r}, not a number")
        out.append((name, int(shots) if num_fewshot is None else num_fewshot))
    if not out:
        raise UserError("--tasks names no task")
    return out


def _heads(node, assigned: dict) -> list[tuple[bool, str]]:
    """[(exact, text)]: the names an expression can take (exact), or their fixed leading text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [(True, node.value)]
    if isinstance(node, ast.JoinedStr):
        head = ""
        for part in node.values:
            if not isinstance(part, ast.Constant):
                break
            head += str(part.value)
        return [(False, head)] if head else []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [(False, t) for _, t in _heads(node.left, assigned)]
    if isinstance(node, ast.IfExp):
        return _heads(node.body, assigned) + _heads(node.orelse, assigned)
    if isinstance(node, ast.Name):
        return [h for value in assigned.get(node.id, []) for h in _heads(value, {})]
    return []


def _names_in(source: str) -> list[tuple[bool, str]]:
    tree = ast.parse(source)
    assigned: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    out = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        called = getattr(func, "id", getattr(func, "attr", None))
        if isinstance(node, ast.Call) and called in ("LightevalTaskConfig", "__init__"):
            for kw in node.keywords:
                if kw.arg == "name":
                    out += _heads(kw.value, assigned)
    return out


@functools.cache
def builtin_index() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """({task name: {module}}, [(leading text of generated names, module)]) of lighteval's
    built-in (non-multilingual) task modules, read from their source."""
    spec = importlib.util.find_spec("lighteval.tasks.tasks")
    root = Path(spec.submodule_search_locations[0])
    files = {
        f"lighteval.tasks.tasks.{f.stem}": f for f in root.glob("*.py") if f.stem != "__init__"
    }
    files |= {f"lighteval.tasks.tasks.{d.name}.main": d / "main.py" for d in root.iterdir()
              if (d / "main.py").is_file()}  # fmt: skip
    exact: dict[str, set[str]] = {}
    prefixes = []
    for module, path in sorted(files.items()):
        for is_exact, text in _names_in(path.read_text(encoding="utf-8")):
            if is_exact:
                exact.setdefault(text, set()).add(module)
            else:
                prefixes.append((text, module))
    return exact, prefixes


def _modules_for(name: str) -> set[str]:
    """The built-in modules that may define `name` or, for a superset (`mmlu`), its subtasks."""
    exact, prefixes = builtin_index()
    found = set(exact.get(name, ()))
    found |= {m for n, ms in exact.items() if n.split(":")[0] == name for m in ms}
    found |= {m for p, m in prefixes if name.startswith(p) or p.split(":")[0] == name}
    return found


def _configs_of(module) -> dict:
    return {c.name: c for c in getattr(module, "TASKS_TABLE", [])}


def check_custom_file(path: str) -> None:
    """Refuse a `--custom-tasks` that is not a .py file."""
    file = Path(path)
    if file.is_file() and file.suffix == ".py":
        return
    what = ("is a folder" if file.is_dir() else "is not a .py file" if file.exists()
            else "does not exist")  # fmt: skip
    raise UserError(f"--custom-tasks {path} {what}; give lighteval's custom-task file (a "
                    "Python file with TASKS_TABLE)")  # fmt: skip


def custom_module(path: str):
    """The custom-task file `path` imported (its `TASKS_TABLE` of `LightevalTaskConfig`s)."""
    from lighteval.tasks.lighteval_task import LightevalTaskConfig

    check_custom_file(path)
    file = Path(path)
    spec = importlib.util.spec_from_file_location(f"mesh3d_custom_tasks_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(f"--custom-tasks {path}, line {e.lineno}: a syntax error ({e.msg}); "
                        "fix the file") from None  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- whatever the user's file raised, as one line
        raise UserError(f"--custom-tasks {path} failed to import ({type(e).__name__}: {e}); "
                        "fix the file or install what it imports") from None  # fmt: skip
    table = getattr(module, "TASKS_TABLE", None)
    if not isinstance(table, list | tuple) or not all(
        isinstance(c, LightevalTaskConfig) for c in table
    ):
        raise UserError(f"--custom-tasks {path}: its TASKS_TABLE must be a list of "
                        f"LightevalTaskConfig, got {table!r:.80}")  # fmt: skip
    return module


def task_configs(specs: list[tuple[str, int]], custom: str | None) -> dict:
    """{name: LightevalTaskConfig} of the custom file and of the built-in modules that hold the
    requested names; an unknown name is refused with the nearest known ones."""
    if custom is not None:
        check_custom_file(custom)
    _lighteval()
    configs = _configs_of(custom_module(custom)) if custom else {}
    for name, _ in specs:
        base = name.split("@")[0]  # `task@param=value`: a metric parameter
        if base in configs:
            continue
        for module in sorted(_modules_for(base)):
            for key, config in _configs_of(importlib.import_module(module)).items():
                configs.setdefault(key, config)
        if not any(n == base or n.split(":")[0] == base for n in configs):
            known = set(builtin_index()[0]) | set(configs)
            near = difflib.get_close_matches(base, known, n=5)
            hint = f"; nearest: {', '.join(near)}" if near else ""
            where = f" in lighteval's tasks or {custom}" if custom else " in lighteval's tasks"
            raise UserError(f"--tasks: no task {base!r}{where}{hint}")
    return configs


def make_registry(specs: list[tuple[str, int]], configs: dict):
    """A lighteval `Registry` of `configs` alone, set up for `specs`."""
    from lighteval.tasks.registry import Registry

    class _Selected(Registry):
        def __init__(self):  # Registry.__init__ would import every built-in task
            self.tasks_list = [f"{name}|{shots}" for name, shots in specs]
            self._load_multilingual, self._custom_tasks = False, None
            self._task_registry = configs
            self.task_to_configs = self._update_task_configs()

    return _Selected()
