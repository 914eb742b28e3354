"""The `lighteval:` section (Nanotron's LightEvalConfig), read with the meaning mesh3d gives it:
downstream scores of saved checkpoints, taken inside the run (`evaluation/in_run.py`) or, with
`mesh3d.eval_mode: slurm_job`, by an sbatch job per checkpoint (`evaluation/slurm_job.py`).

Task strings are Nanotron's (lighteval's `suite|task|few-shot|truncate`, comma-separated) or
lm-eval task names; `lm_eval_tasks` turns them into lm-eval names and few-shot counts
(`LIGHTEVAL_TO_LM_EVAL` names the mapping). The `slurm`, `slurm_script_dir`, `slurm_template`,
`logs_path` and `parallelism` keys act in slurm_job mode only; keys that only mean something on
Hugging Face's cluster (hub pushes, s3_save_path, nanotron_path...) are accepted and unused; the
compatibility page lists them.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from mesh3d.errors import ConfigError

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
SLURM_KEYS = {
    "gpus_per_node",
    "partition",
    "hf_cache",
    "cpus_per_task",
    "qos",
    "time",
    "reservation",
}
# what `{{ name }}` in a `slurm_template` file is replaced with (evaluation/slurm_job.py)
PLACEHOLDERS = {"job_name", "step", "checkpoint", "output_dir", "log_file", "nodes", "gpus",
                "sbatch_lines", "command"}  # fmt: skip
TASK_KEYS = {"tasks", "custom_tasks", "max_samples", "num_fewshot_seeds", "dataset_loading_processes",
             "multichoice_continuations_start_space", "no_multichoice_continuations_start_space"}  # fmt: skip


def lm_eval_tasks(spec: str) -> list[tuple[str, int | None]]:
    """(lm-eval task, few-shot count or None for the task's own) of each comma-separated entry:
    `suite|task|k|truncate` (lighteval's form; the task mapped by `LIGHTEVAL_TO_LM_EVAL` when
    listed there, else taken as an lm-eval name) or a plain lm-eval task name. A few-shot count
    that is not a number is a `ConfigError`."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if "|" in entry:
            parts = entry.split("|")
            task = parts[1] if len(parts) > 1 else parts[0]
            shots = parts[2].strip() if len(parts) > 2 else ""
            if shots and not shots.isdigit():
                raise ConfigError(f"`lighteval.tasks.tasks`: the few-shot count of {entry!r} is "
                                  f"{shots!r}, not a number; write suite|task|shots|truncate "
                                  "with shots an integer >= 0")  # fmt: skip
            out.append((LIGHTEVAL_TO_LM_EVAL.get(task, task), int(shots) if shots else None))
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
    section, mode = cfg.lighteval, cfg.mesh3d.eval_mode
    if mode not in ("in_run", "slurm_job"):
        yield f"`mesh3d.eval_mode` {mode!r} is not one of in_run, slurm_job"
    if section is None:
        if mode == "slurm_job":
            yield ("`mesh3d.eval_mode: slurm_job` submits the evaluations of the `lighteval:` "
                   "section, and this config has none: add one or remove eval_mode")  # fmt: skip
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
    else:
        if set(tasks) - TASK_KEYS:
            yield f"`lighteval.tasks` has unknown key(s) {sorted(set(tasks) - TASK_KEYS)}; known: {sorted(TASK_KEYS)}"
        most = tasks.get("max_samples")
        if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < 1):
            yield f"`lighteval.tasks.max_samples` must be an integer >= 1 or null, got {most!r}"
        try:
            lm_eval_tasks(tasks["tasks"])
        except ConfigError as e:
            yield str(e)
        custom = tasks.get("custom_tasks")
        if custom is not None and mode == "in_run" and not Path(str(custom)).exists():
            yield (f"`lighteval.tasks.custom_tasks` {custom} does not exist; give a folder of "
                   "lm-eval task YAMLs, or lighteval's custom-task .py (eval_engine: lighteval)")  # fmt: skip
    not_mappings = [k for k in ("logging", "slurm", "parallelism")
                    if section.get(k) is not None and not isinstance(section[k], dict)]  # fmt: skip
    for key in not_mappings:
        yield f"`lighteval.{key}` must be a mapping (or null), got {section[key]!r}"
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
    if mode == "slurm_job" and not not_mappings:
        yield from _slurm_job_errors(cfg, section)
    elif cfg.parallelism.context_parallel_size > 1:
        yield ("`lighteval` in-run evaluation at context_parallel_size > 1 is not supported yet: "
               "set mesh3d.eval_mode: slurm_job, or lighteval: null and score the saved "
               "checkpoints with `mesh3d eval`")  # fmt: skip


def sbatch_binary() -> str | None:
    """The sbatch that submits evaluation jobs: `$MESH3D_SBATCH` (a path or a name), else
    `sbatch` on PATH; None when it is not there."""
    return shutil.which(os.environ.get("MESH3D_SBATCH") or "sbatch")


def eval_ranks(section: dict) -> tuple[int, int, int]:
    """(dp, tp, pp) of an evaluation job: `lighteval.parallelism`, 1 where not given."""
    par = section.get("parallelism") or {}
    return par.get("dp", 1), par.get("tp", 1), par.get("pp", 1)


def template_names(text: str) -> set[str]:
    return set(re.findall(r"{{\s*(\w+)\s*}}", text))


def _slurm_job_errors(cfg, section: dict) -> Iterator[str]:
    """What keeps `mesh3d.eval_mode: slurm_job` from writing and submitting its jobs."""
    if sbatch_binary() is None:
        named = os.environ.get("MESH3D_SBATCH")
        where = (
            f"MESH3D_SBATCH ({named!r}) is not an executable" if named else "no sbatch is on PATH"
        )
        yield (f"`mesh3d.eval_mode: slurm_job` submits each evaluation with sbatch, and {where}: "
               "run on a Slurm node, set MESH3D_SBATCH to the sbatch binary, or set "
               "mesh3d.eval_mode: in_run")  # fmt: skip
    if cfg.s3_upload is not None and cfg.s3_upload.remove_after_upload:
        yield ("`mesh3d.eval_mode: slurm_job` jobs read the local step folders, and "
               "`s3_upload.remove_after_upload: true` deletes them once uploaded: set it to false "
               "(or mesh3d.eval_mode: in_run)")  # fmt: skip
    ranks = eval_ranks(section)
    if not all(isinstance(n, int) and n >= 1 for n in ranks):
        yield f"`lighteval.parallelism` dp, tp, pp must be integers >= 1, got {list(ranks)}"
        return
    slurm = section.get("slurm") or {}  # a mapping: `eval_errors` checked
    if set(slurm) - SLURM_KEYS:
        extra = sorted(set(slurm) - SLURM_KEYS)
        yield f"`lighteval.slurm` has unknown key(s) {extra}; known: {sorted(SLURM_KEYS)}"
        return
    gpus, n = slurm.get("gpus_per_node"), ranks[0] * ranks[1] * ranks[2]
    if gpus is not None and (not isinstance(gpus, int) or gpus < n):
        yield (f"`lighteval.slurm.gpus_per_node` ({gpus!r}) must be at least the evaluation's "
               f"ranks, lighteval.parallelism dp x tp x pp = {n}: the job runs on one node")  # fmt: skip
    template = section.get("slurm_template")
    if template is not None:
        path = Path(str(template)).expanduser()
        if not path.is_file():
            yield f"`lighteval.slurm_template` {template} is not a file: give a job script template or null"
            return
        names = template_names(path.read_text())
        if names - PLACEHOLDERS or "command" not in names:
            yield (f"`lighteval.slurm_template` {template}: placeholders must be among "
                   f"{sorted(PLACEHOLDERS)} and include {{{{ command }}}}, got {sorted(names)}")  # fmt: skip
