"""`mesh3d eval`'s refusals: one line, exit 2, before any model is built (no process group)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

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


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """`--output-dir evals` (the default) is created before the task checks: not in the repo."""
    monkeypatch.chdir(tmp_path)


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
    assert "--dp 1 x --tp 2 x --pp 1 = 2 ranks, but 1 process(es) run" in _refused(
        step, "--tasks", "x", "--tp", "2"
    )
    assert ">= 1" in _refused(step, "--tasks", "x", "--batch-size", "0")
    assert "does not exist" in _refused(str(root / "missing"), "--tasks", "x")


# (flags after CHECKPOINT --tasks tiny_mc --custom-tasks TASKS, what the line says); {root}
# is the fixture's folder
BAD_FLAGS = [
    (["--num-fewshot", "-1"], "--num-fewshot -1 must be >= 0"),
    (["--max-length", "0"], "--max-length 0 must be >= 1"),
    (["--max-length", "-5"], "--max-length -5 must be >= 1"),
    (["--max-samples", "0"], "--max-samples 0 must be >= 1"),
    (["--batch-size", "100000000000"], "--batch-size 100000000000 x --max-length 2048 is"),
    (["--max-length", "3000000000"], "--max-length 3000000000 is more than 2147483647"),
    (["--dp", "0"], "--dp 0 must be >= 1"),
    (["--pp", "0"], "--pp 0 must be >= 1"),
    (["--tp", "0"], "--tp 0 must be >= 1"),
    (["--tp", "-1"], "--tp -1 must be >= 1"),
    (["--output-dir", "{root}/tasks/tiny_mc.yaml"], "a file is where a folder is needed"),
    (["--output-dir", "/proc/x"], "`--output-dir` /proc/x: cannot write there"),
    (["--tokenizer", "/nonexist"], "--tokenizer /nonexist does not exist"),
    (["--tokenizer", "{root}/tasks"], "--tokenizer {root}/tasks holds no tokenizer.json"),
    (["--tokenizer", "{root}/tasks/tiny_mc.yaml"], "tiny_mc.yaml is not a tokenizer.json"),
    (["--custom-tasks", "{root}/tasks/tiny_mc.yaml"], "tiny_mc.yaml is a file; give a folder"),
    (["--tasks", "custom|tiny_mc|0|1"], "are lighteval's: add --engine lighteval"),
    (["--tasks", "tiny_mc, tiny_mcq"], "no task 'tiny_mcq'"),  # spaces stripped
]  # fmt: skip


@pytest.mark.parametrize(
    "flags, says", BAD_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_bad_flags_are_refused_by_name_before_the_evaluation(root, flags, says):
    flags = [f.replace("{root}", str(root)) for f in flags]
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks",
                    str(root / "tasks"), *flags)  # fmt: skip
    assert says.replace("{root}", str(root)) in line, line


def test_a_task_yaml_that_does_not_parse_is_named(root, tmp_path):
    (tmp_path / "tiny_mc.yaml").write_text((root / "tasks" / "tiny_mc.yaml").read_text())
    (tmp_path / "broken.yaml").write_text("task: broken\n  x: [\n")
    line = _refused(str(root / "ck" / "3"), "--tasks", "broken", "--custom-tasks", str(tmp_path))
    assert f"{tmp_path / 'broken.yaml'}, line 2 did not parse" in line, line


def test_more_few_shot_examples_than_a_task_has_is_one_line(root, monkeypatch):
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast

    from mesh3d.evaluation import cli as eval_cli

    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok" / "tokenizer.json"))
    tok.eos_token = tok.convert_ids_to_tokens(0)
    # the examples are drawn before any request reaches the model
    monkeypatch.setattr(eval_cli, "_scorer", lambda *a: (tok, SimpleNamespace(length=64)))
    line = _refused(str(root / "ck" / "3"), "--tasks", "tiny_mc", "--custom-tasks",
                    str(root / "tasks"), "--num-fewshot", "100000", "--max-samples", "1",
                    "--output-dir", str(root / "out"))  # fmt: skip
    assert "--num-fewshot 100000 is more than a task of --tasks tiny_mc has" in line, line


# --- the lighteval: section ---------------------------------------------------------------

# the section as Nanotron's µP example writes it (its keys and structure; values its own)
NANOTRON_SECTION = """
lighteval:
  batch_size: 16
  checkpoints_path: null
  generation: null
  logging:
    hub_repo_details: null
    hub_repo_results: null
    local_output_path: /tmp/evals/logs
    push_details_to_hub: null
    push_results_to_hub: null
    push_results_to_tensorboard: true
    tensorboard_metric_prefix: e
  parallelism:
    dp: 2
    expert_parallel_size: 1
    pp: 1
    pp_engine: 1f1b
    tp: 2
    tp_linear_async_communication: false
    tp_mode: ALL_REDUCE
  tasks:
    dataset_loading_processes: 8
    max_samples: 1000
    multichoice_continuations_start_space: null
    no_multichoice_continuations_start_space: null
    num_fewshot_seeds: null
    tasks: early-signal
  wandb: null
"""


def _errors(section: str, *overrides: str) -> list[str]:
    import copy

    import yaml
    from parity import TINY

    from mesh3d.checks.validate import validation_errors
    from mesh3d.config import apply_overrides, config_from_dict

    d = copy.deepcopy(TINY) | yaml.safe_load(section)
    d.setdefault("checkpoints", {"checkpoints_path": "ck", "checkpoint_interval": 10})
    return validation_errors(apply_overrides(config_from_dict(d), list(overrides)))


def test_nanotrons_section_validates_as_written():
    assert _errors(NANOTRON_SECTION) == []


def test_a_section_mesh3d_cannot_run_is_refused_with_the_fix():
    bad = NANOTRON_SECTION.replace("  batch_size: 16", "  batch_size: 16\n  eval_every: 3")
    assert any("unknown key(s) ['eval_every']" in e for e in _errors(bad))
    assert any("multiple of `checkpoints.checkpoint_interval` (10)" in e
               for e in _errors(NANOTRON_SECTION, "lighteval.eval_interval=15"))  # fmt: skip
    assert _errors(NANOTRON_SECTION, "lighteval.eval_interval=20") == []
    no_tasks = NANOTRON_SECTION.replace("    tasks: early-signal\n", "")
    assert any("`lighteval.tasks.tasks` must name the tasks" in e for e in _errors(no_tasks))
    assert any("context_parallel_size > 1 is not supported yet" in e
               for e in _errors(NANOTRON_SECTION, "parallelism.context_parallel_size=2"))  # fmt: skip
    assert any("`mesh3d.eval_failure` 'halt'" in e
               for e in _errors(NANOTRON_SECTION, "mesh3d.eval_failure=halt"))  # fmt: skip


@pytest.mark.parametrize("override, says", [
    ("lighteval.tasks.max_samples=abc", "`lighteval.tasks.max_samples` must be an integer >= 1 or null, got 'abc'"),
    ("lighteval.tasks.max_samples=0", "`lighteval.tasks.max_samples` must be an integer >= 1 or null, got 0"),
    ("lighteval.logging=5", "`lighteval.logging` must be a mapping (or null), got 5"),
    ("lighteval.slurm=[1]", "`lighteval.slurm` must be a mapping (or null), got [1]"),
    ("lighteval.parallelism=2", "`lighteval.parallelism` must be a mapping (or null), got 2"),
    ("lighteval.tasks.tasks=custom|tiny_mc|five|0", "the few-shot count of 'custom|tiny_mc|five|0' is 'five', not a number"),
])  # fmt: skip
def test_a_bad_lighteval_value_is_refused_by_its_key(override, says):
    errors = _errors(NANOTRON_SECTION, override)
    assert any(says in e for e in errors), errors
    slurm = _errors(NANOTRON_SECTION, override, "mesh3d.eval_mode=slurm_job")  # no traceback
    assert any(says in e for e in slurm), slurm


def test_lighteval_task_strings_map_to_lm_eval_tasks():
    from mesh3d.checks.eval_checks import lm_eval_tasks

    got = lm_eval_tasks("lighteval|hellaswag|0|1, leaderboard|arc:challenge|25|0,piqa,siqa")
    assert got == [("hellaswag", 0), ("arc_challenge", 25), ("piqa", None), ("social_iqa", None)]


def test_a_chat_task_with_a_tokenizer_without_a_chat_template_is_refused(root, tmp_path):
    import copy
    import dataclasses

    from parity import TINY

    from mesh3d.config import config_from_dict

    step = tmp_path / "ck" / "1"
    (step / "tokenizer").mkdir(parents=True)
    mc = config_from_dict(copy.deepcopy(TINY)).model.model_config
    (step / "model_config.json").write_text(json.dumps(dataclasses.asdict(mc)))
    (step / "tokenizer" / "tokenizer.json").write_bytes(
        (root / "tok" / "tokenizer.json").read_bytes()
    )
    line = _refused(str(step), "--tasks", "tiny_mc", "--custom-tasks", str(root / "tasks"),
                    "--apply-chat-template")  # fmt: skip
    assert "--apply-chat-template: the tokenizer of" in line and "has no chat template" in line, (
        line
    )


def _config(section: str):
    import copy

    import yaml
    from parity import TINY

    from mesh3d.config import config_from_dict

    d = copy.deepcopy(TINY) | yaml.safe_load(section)
    d.setdefault("checkpoints", {"checkpoints_path": "ck", "checkpoint_interval": 10})
    return config_from_dict(d)


@pytest.mark.parametrize("engine", ["lm-eval", "lighteval"])
def test_a_run_names_the_lighteval_keys_not_the_eval_commands_flags(root, tmp_path, engine):
    """A run's `lighteval:` section was refused in `mesh3d eval`'s words (`--tasks: no task`,
    `--custom-tasks ... is a folder`)."""
    from mesh3d.errors import UserError
    from mesh3d.evaluation.in_run import InRunEvaluation

    section = f"lighteval: {{tasks: {{tasks: tiny_mcq, custom_tasks: {root / 'tasks'}}}}}"
    cfg = _config(section + f"\nmesh3d: {{eval_engine: {engine}}}")
    with pytest.raises(UserError) as e:
        InRunEvaluation(cfg, tmp_path)
    says = {"lm-eval": "`lighteval.tasks.tasks`: no task 'tiny_mcq' in lm-eval's tasks or",
            "lighteval": f"`lighteval.tasks.custom_tasks` {root / 'tasks'} is a folder"}  # fmt: skip
    assert says[engine] in str(e.value) and "--" not in str(e.value), str(e.value)


def test_a_missing_custom_tasks_path_fails_the_config_check(tmp_path):
    """`mesh3d config` passed it; the run refused it only once started."""
    errors = _errors(f"lighteval: {{tasks: {{tasks: tiny_mc, custom_tasks: {tmp_path / 'no'}}}}}")
    assert f"`lighteval.tasks.custom_tasks` {tmp_path / 'no'} does not exist" in errors[0], errors


def test_a_lora_checkpoint_whose_base_is_gone_is_named_so(root, tmp_path):
    """It was refused as "`model.init_method.path` ... does not exist", a key never set here."""
    step = tmp_path / "ck" / "3"
    shutil.copytree(root / "ck" / "3", step)
    base = {"init": "path", "path": str(tmp_path / "gone"), "sha256": "0"}
    meta = {"custom_metas": {"lora": {"base": base}}}  # what lora_of reads of a LoRA run's
    (step / "checkpoint_metadata.json").write_text(json.dumps(meta))
    line = _refused(str(step), "--tasks", "tiny_mc", "--custom-tasks", str(root / "tasks"))
    assert f"holds LoRA adapters for the base {tmp_path / 'gone'}, which is gone" in line, line
