"""Bad input to `mesh3d generate`, `mesh3d eval` and `mesh3d plan` (found by fuzzing): one
`error:` line naming the flag or file, the value and the fix, exit 2, no traceback."""

from __future__ import annotations

import json

import pytest

from mesh3d.data.synthetic import make_tokenizer
from mesh3d.evaluation.cli import main as eval_main
from mesh3d.generate import main as generate_main
from mesh3d.plan.__main__ import main as plan_main


def _refused(capsys, entry, *argv: str) -> str:
    """The one `error:` line `entry(argv)` prints as it exits 2."""
    with pytest.raises(SystemExit) as e:
        entry(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def step(tmp_path):
    """A step folder as far as the commands read it before any weights: its model config."""
    step = tmp_path / "ck" / "3"
    step.mkdir(parents=True)
    (step / "model_config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 300}))
    return step


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_refuses_a_non_finite_temperature(capsys, step, value):
    line = _refused(capsys, generate_main, "--checkpoint", str(step), "--prompt", "def f",
                    "--temperature", value, "--max-new-tokens", "3")  # fmt: skip
    assert f"--temperature {float(value)} must be a finite number >= 0" in line, line


def test_generate_names_a_prompts_file_that_is_not_utf8(capsys, step, tmp_path):
    tok = make_tokenizer(tmp_path / "tok", vocab_size=300)
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"def f\n\xff\xfe oops\n")
    line = _refused(capsys, generate_main, "--checkpoint", str(step), "--tokenizer", str(tok),
                    "--prompts", str(prompts))  # fmt: skip
    assert f"--prompts {str(prompts)!r} is not UTF-8 text (byte 6: " in line, line
    assert "save it as UTF-8" in line, line


def test_generate_refuses_a_kv_cache_larger_than_the_machine(capsys, step, tmp_path):
    tok = make_tokenizer(tmp_path / "tok", vocab_size=300)
    line = _refused(capsys, generate_main, "--checkpoint", str(step), "--tokenizer", str(tok),
                    "--prompt", "def f", "--max-new-tokens", str(10**15), "--device", "cpu")  # fmt: skip
    assert f"--max-new-tokens {10**15}: the KV cache of 1 x " in line, line
    fits = int(line.split("give at most ")[1].split(" ")[0].replace(",", ""))
    assert 0 < fits < 10**15, line
    # the most it names gets past the check (to the weights this step folder lacks)
    line = _refused(capsys, generate_main, "--checkpoint", str(step), "--tokenizer", str(tok),
                    "--prompt", "def f", "--max-new-tokens", str(fits), "--device", "cpu")  # fmt: skip
    assert "KV cache" not in line and "has no model/ folder" in line, line


@pytest.mark.parametrize("tasks", ["", ",", " , "])
def test_eval_refuses_an_empty_task_list(capsys, step, tasks):
    line = _refused(capsys, eval_main, str(step), "--tasks", tasks, "--max-samples", "1")
    assert f"--tasks {tasks!r} names no task" in line, line


@pytest.fixture
def offline_tasks(tmp_path, monkeypatch):
    """The local lm-eval tasks of `eval_fixtures`, each load (the data download) replaced by
    `monkeypatch.setattr(TaskManager, "load", ...)` in the test."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    from eval_fixtures import write_tasks

    return write_tasks(tmp_path)


def _failing_load(error: Exception):
    def load(self, tasks):
        raise error

    return load


@pytest.mark.parametrize("error", ["ConnectionError", "LocalEntryNotFoundError"])
def test_eval_names_a_task_whose_data_cannot_be_downloaded(capsys, step, offline_tasks,
                                                           monkeypatch, error):  # fmt: skip
    from huggingface_hub.errors import LocalEntryNotFoundError
    from lm_eval.tasks import TaskManager

    kind = {"ConnectionError": ConnectionError, "LocalEntryNotFoundError": LocalEntryNotFoundError}
    monkeypatch.setattr(TaskManager, "load", _failing_load(kind[error]("Couldn't reach the Hub")))
    line = _refused(capsys, eval_main, str(step), "--tasks", "tiny_mc",
                    "--custom-tasks", str(offline_tasks))  # fmt: skip
    assert "the data of task 'tiny_mc' could not be downloaded (Couldn't reach the Hub)" in line
    assert "HF_DATASETS_OFFLINE" in line, line


def test_eval_lets_other_task_loading_errors_through(step, offline_tasks, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(TaskManager, "load", _failing_load(RuntimeError("a real bug")))
    with pytest.raises(RuntimeError, match="a real bug"):
        eval_main([str(step), "--tasks", "tiny_mc", "--custom-tasks", str(offline_tasks)])


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_plan_refuses_a_gpu_memory_that_is_not_a_positive_number(capsys, value):
    line = _refused(capsys, plan_main, "--gpu-memory", value)
    assert f"--gpu-memory {value!r} must be a positive number of GiB" in line, line


def test_config_and_train_refuse_an_empty_config_path(capsys):
    """`mesh3d config "$CFG"` with CFG unset checked the built-in default and passed."""
    from mesh3d.checks.__main__ import main as config_main
    from mesh3d.launch import main as train_main

    assert "CONFIG '' is empty (an unset variable?)" in _refused(capsys, config_main, "")
    assert "CONFIG ' ' is empty; give a file" in _refused(capsys, train_main, " ")


@pytest.mark.parametrize("argv, says", [
    (["--config-file", "cfg.yaml", "tokens.train_steps"], "'tokens.train_steps' is no override (KEY=VALUE), and --config-file cfg.yaml names the config"),
    (["a.yaml", "--config-file", "b.yaml"], "'a.yaml' is no override (KEY=VALUE), and --config-file b.yaml"),
    (["--config-file", ""], "--config-file '' is empty; give a file"),
    (["--metrics-file", " "], "--metrics-file ' ' is empty; give a file"),
])  # fmt: skip
def test_train_refuses_what_it_would_drop(capsys, argv, says):
    """With --config-file, a positional (an override missing its `=`, or a second config) was
    dropped and the run trained without it; `--config-file ""` trained the built-in default
    for minutes, `--metrics-file ""` wrote the default file."""
    from mesh3d.launch import main as train_main

    assert says in _refused(capsys, train_main, *argv)


@pytest.mark.parametrize("size", ["0", "-1"])
def test_config_refuses_a_world_size_below_one(capsys, size):
    from mesh3d.checks.__main__ import main as config_main

    line = _refused(capsys, config_main, "--world-size", size)
    assert f"--world-size {size} must be >= 1" in line, line


def test_an_unknown_section_is_blamed_on_its_override(capsys):
    from mesh3d.checks.__main__ import main as config_main

    line = _refused(capsys, config_main, "foo.bar=1")
    assert line.startswith("error: override 'foo.bar=1': unknown key `foo`"), line


@pytest.mark.parametrize(
    "flags,says",
    [(["--write", "best.yaml"], "--write only applies to a layout search: add --search"),
     (["--hardware", "a100-80g", "--top", "3"], "--hardware, --top only apply to a layout search"),
     (["--search", "--world-size", "4", "--top", "0"], "--top 0 must be >= 1"),
     (["--search", "--world-size", "4", "--nodes-of", "-2"], "--nodes-of -2 must be >= 1")],
)  # fmt: skip
def test_plan_refuses_search_flags_without_a_search_and_counts_below_one(capsys, flags, says):
    """`plan --write best.yaml` printed the plan, wrote nothing and said nothing."""
    line = _refused(capsys, plan_main, *flags)
    assert says in line, line
