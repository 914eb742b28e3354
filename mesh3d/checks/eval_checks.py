"""The `lighteval:` section (Nanotron's LightEvalConfig), read with the meaning mesh3d gives it:
downstream scores taken inside the run after saved checkpoints (`evaluation/in_run.py`).

Task strings are Nanotron's (lighteval's `suite|task|few-shot|truncate`, comma-separated) or
lm-eval task names; `lm_eval_tasks` turns them into lm-eval names and few-shot counts
(`LIGHTEVAL_TO_LM_EVAL` names the mapping). Keys that only mean something on Hugging Face's
cluster (slurm, hub pushes, s3_save_path, nanotron_path...) are accepted and unused; the
compatibility page lists them.
"""

from __future__ import annotations

from collections.abc import Iterator

# lighteval task name -> the lm-evaluation-harness task that scores the same benchmark
LIGHTEVAL_TO_LM_EVAL = {
    "hellaswag": "hellaswag", "arc:easy": "arc_easy", "arc:challenge": "arc_challenge",
    "piqa": "piqa", "winogrande": "winogrande", "openbookqa": "openbookqa", "mmlu": "mmlu",
    "boolq": "boolq", "commonsense_qa": "commonsense_qa", "siqa": "social_iqa",
    "triviaqa": "triviaqa", "gsm8k": "gsm8k", "lambada:openai": "lambada_openai",
    "wikitext": "wikitext", "sciq": "sciq", "copa": "copa", "truthfulqa:mc": "truthfulqa_mc1",
    "race:high": "race", "mathqa": "mathqa", "natural_questions": "nq_open",
}  # fmt: skip

KNOWN = {
    "slurm_script_dir", "slurm_template", "logs_path", "local_checkpoint_dir", "checkpoints_path",
    "parallelism", "batch_size", "generation", "tasks", "logging", "wandb", "slurm",
    "s3_save_path", "upload_to_wandb", "wandb_project", "wandb_entity", "output_dir",
    "nanotron_path", "eval_config_override", "eval_interval", "eval_interval_file",
}  # fmt: skip
TASK_KEYS = {"tasks", "custom_tasks", "max_samples", "num_fewshot_seeds", "dataset_loading_processes",
             "multichoice_continuations_start_space", "no_multichoice_continuations_start_space"}  # fmt: skip


def lm_eval_tasks(spec: str) -> list[tuple[str, int | None]]:
    """(lm-eval task, few-shot count or None for the task's own) of each comma-separated entry:
    `suite|task|k|truncate` (lighteval's form; the task mapped by `LIGHTEVAL_TO_LM_EVAL` when
    listed there, else taken as an lm-eval name) or a plain lm-eval task name."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if "|" in entry:
            parts = entry.split("|")
            task = parts[1] if len(parts) > 1 else parts[0]
            shots = int(parts[2]) if len(parts) > 2 and parts[2].strip().isdigit() else None
            out.append((LIGHTEVAL_TO_LM_EVAL.get(task, task), shots))
        else:
            out.append((LIGHTEVAL_TO_LM_EVAL.get(entry, entry), None))
    return out


def eval_interval(cfg) -> int | None:
    """Steps between evaluations: `lighteval.eval_interval`, else `checkpoint_interval`."""
    section = cfg.lighteval
    if section is None or cfg.checkpoints is None:
        return None
    return section.get("eval_interval") or cfg.checkpoints.checkpoint_interval


def eval_errors(cfg) -> Iterator[str]:
    """What in the `lighteval:` section cannot run as written."""
    section = cfg.lighteval
    if section is None:
        return
    if not isinstance(section, dict):
        yield f"`lighteval` must be a mapping (or null), got {type(section).__name__}"
        return
    unknown = sorted(set(section) - KNOWN)
    if unknown:
        yield (f"`lighteval` has unknown key(s) {unknown}; known: {sorted(KNOWN)} (Nanotron's "
               "LightEvalConfig)")  # fmt: skip
    tasks = section.get("tasks")
    if (
        not isinstance(tasks, dict)
        or not isinstance(tasks.get("tasks"), str)
        or not tasks["tasks"].strip()
    ):
        yield ("`lighteval.tasks.tasks` must name the tasks to score (comma-separated lm-eval "
               "names or lighteval's suite|task|few-shot|truncate), e.g. tasks: {tasks: hellaswag}")  # fmt: skip
    elif set(tasks) - TASK_KEYS:
        yield f"`lighteval.tasks` has unknown key(s) {sorted(set(tasks) - TASK_KEYS)}; known: {sorted(TASK_KEYS)}"
    if cfg.checkpoints is None:
        yield ("`lighteval` scores saved checkpoints, and this config has no `checkpoints` "
               "section: add one (checkpoint_interval, checkpoints_path) or set lighteval: null")  # fmt: skip
        return
    every, interval = section.get("eval_interval"), cfg.checkpoints.checkpoint_interval
    if every is not None and (not isinstance(every, int) or every < 1 or every % interval):
        yield (f"`lighteval.eval_interval` ({every!r}) must be a multiple of "
               f"`checkpoints.checkpoint_interval` ({interval}): an evaluation scores a saved "
               f"checkpoint; e.g. {interval}")  # fmt: skip
    batch = section.get("batch_size")
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        yield f"`lighteval.batch_size` must be a positive integer or null, got {batch!r}"
    if cfg.parallelism.context_parallel_size > 1:
        yield ("`lighteval` in-run evaluation at context_parallel_size > 1 is not supported yet: "
               "set lighteval: null and score the saved checkpoints with `mesh3d eval`")  # fmt: skip
