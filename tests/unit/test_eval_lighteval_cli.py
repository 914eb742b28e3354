"""`mesh3d eval --engine lighteval`'s task strings and refusals: Nanotron's task strings read,
an unknown task or a missing custom-task file refused in one line, exit 2, before any model is built."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip(
    "lighteval", reason="lighteval is not installed: pip install 'mesh3d[lighteval]'"
)

from eval_fixtures import write_lighteval_tasks, write_tasks  # noqa: E402

from mesh3d.cli import main as cli  # noqa: E402
from mesh3d.errors import UserError  # noqa: E402
from mesh3d.evaluation.lighteval_tasks import task_specs  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightevalcli")
    write_tasks(root)
    write_lighteval_tasks(root)
    step = root / "ck" / "3"
    step.mkdir(parents=True)
    (step / "model_config.json").write_text(json.dumps({"hidden_size": 64}))
    (step / "config.yaml").write_text("tokenizer:\n  tokenizer_name_or_path: /nowhere/tok\n")
    return root


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """`--output-dir evals` (the default) is created before the task checks: not in the repo."""
    monkeypatch.chdir(tmp_path)


def _refused(*argv: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli(["eval", *argv, "--engine", "lighteval"])
    assert e.value.code == 2, err.getvalue()
    lines = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err.getvalue()
    return lines[0]


def test_task_strings_in_lightevals_and_nanotrons_syntax():
    got = task_specs("lighteval|hellaswag|0|1, leaderboard|arc:challenge|25|0,piqa,mmlu|5")
    assert got == [("hellaswag", 0), ("arc:challenge", 25), ("piqa", 0), ("mmlu", 5)]
    assert task_specs("a|3,b", num_fewshot=1) == [("a", 1), ("b", 1)]
    with pytest.raises(UserError, match="few-shot count of 'x|y' is 'y'"):
        task_specs("x|y")


def test_an_unknown_task_names_the_nearest_ones(root):
    custom = str(root / "lighteval_tasks.py")
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mcq", "--custom-tasks", custom)
    assert "no task 'tiny_mcq' in lighteval's tasks or" in line and "nearest: tiny_mc" in line
    line = _refused(str(root / "ck" / "3"), "--tasks", "lighteval|hellaswagg|0|1")
    assert "no task 'hellaswagg'" in line and "nearest: hellaswag" in line, line


def test_a_missing_custom_task_file_is_named(root):
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks",
                    str(root / "nope.py"))  # fmt: skip
    assert f"--custom-tasks {root / 'nope.py'} does not exist" in line, line


# (the custom-task file's text, or None for a folder; what the line says)
BAD_CUSTOM_TASKS = [
    (None, "is a folder; give lighteval's custom-task file"),
    ("TASKS_TABLE = [\n", "custom.py, line 1: a syntax error"),
    ("import no_such_module_here\n", "custom.py failed to import (ModuleNotFoundError: No module"),
    ("TASKS_TABLE = [5]\n", "custom.py: its TASKS_TABLE must be a list of LightevalTaskConfig, got [5]"),
]  # fmt: skip


@pytest.mark.parametrize("text, says", BAD_CUSTOM_TASKS)
def test_a_bad_custom_task_file_is_one_line_naming_it(root, tmp_path, text, says):
    path = tmp_path / "custom.py"
    if text is None:
        path.mkdir()
    else:
        path.write_text(text)
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks", str(path))
    assert f"--custom-tasks {path}" in line and says in line, line


@pytest.mark.parametrize("flags, says", [
    (["--num-fewshot", "-1"], "--num-fewshot -1 must be >= 0"),
    (["--output-dir", "/proc/x"], "`--output-dir` /proc/x: cannot write there"),
])  # fmt: skip
def test_bad_flags_are_refused_before_the_evaluation(root, flags, says):
    custom = str(root / "lighteval_tasks.py")
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks", custom, *flags)
    assert says in line, line
