"""`mesh3d eval`'s refusals: one line, exit 2, before any model is built (no process group)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install 'mesh3d[eval]'"
)

from eval_fixtures import write_tasks  # noqa: E402

from mesh3d.cli import main as cli  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalcli")
    write_tasks(root)
    step = root / "ck" / "3"
    step.mkdir(parents=True)
    (step / "model_config.json").write_text(json.dumps({"hidden_size": 64}))
    (step / "config.yaml").write_text("tokenizer:\n  tokenizer_name_or_path: /nowhere/tok\n")
    return root


def _refused(*argv: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli(["eval", *argv])
    assert e.value.code == 2, err.getvalue()
    lines = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err.getvalue()
    return lines[0]


def test_an_unknown_task_names_the_nearest_ones(root):
    line = _refused(
        str(root / "ck" / "3"), "--tasks", "tiny_mcq", "--custom-tasks", str(root / "tasks")
    )
    assert "no task 'tiny_mcq'" in line and "nearest: tiny_mc" in line, line


def test_a_missing_custom_task_path_is_named(root):
    line = _refused(
        str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks", str(root / "nope")
    )
    assert f"--custom-tasks {root / 'nope'} does not exist" in line, line


def test_a_checkpoint_without_a_tokenizer_says_how_to_give_one(root):
    line = _refused(
        str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks", str(root / "tasks")
    )
    assert "no tokenizer for" in line and "--tokenizer" in line and "/nowhere/tok" in line, line


def test_layout_engine_and_numbers_are_checked_first(root):
    step = str(root / "ck" / "3")
    assert "--tp 2 x --pp 1 = 2 ranks, but 1 process(es) run" in _refused(
        step, "--tasks", "x", "--tp", "2"
    )
    assert "--engine lighteval is not available yet" in _refused(
        step, "--tasks", "x", "--engine", "lighteval"
    )
    assert ">= 1" in _refused(step, "--tasks", "x", "--batch-size", "0")
    assert "does not exist" in _refused(str(root / "missing"), "--tasks", "x")
