"""Evaluations as Slurm jobs (`mesh3d.eval_mode: slurm_job`): Nanotron's way, so training never
pauses for them.

After the checkpoint of every `lighteval.eval_interval`-th step is committed (a background save
too, when it is), world rank 0 writes a job script and submits it with sbatch (`$MESH3D_SBATCH`,
else `sbatch` on PATH; the config check refuses a run without one). The job runs `mesh3d eval`
on that step folder, with the run's Python, from the folder the run started in:

    python -m mesh3d.cli eval CK/4 --engine lm-eval --tasks tiny_mc --batch-size 8 \\
        --output-dir <lighteval.logging.local_output_path or <run>/evals>/4 [--custom-tasks ...]

under `python -m torch.distributed.run --standalone --nproc_per_node=N` with `--dp --tp --pp`
when `lighteval.parallelism` asks for N = dp x tp x pp > 1 ranks (on one node). The `#SBATCH`
lines come from `lighteval.slurm` (`partition`, `qos`, `time`, `reservation`, `cpus_per_task`:
written only when given; `gpus_per_node`: the GPUs asked for, default N) and `hf_cache` becomes
`HF_HOME`. `lighteval.slurm_template`, a file, replaces the whole script: its `{{ name }}`
placeholders (`checks/eval_checks.PLACEHOLDERS`) are filled in.

The checkpoint is read in place, never copied or written: retention
(`mesh3d.keep_last_checkpoints`) never deletes the folder of an evaluated step
(`EvalJobs.spared`), so a job that waits in the queue still finds it (the config check refuses
`s3_upload.remove_after_upload`, which would delete it). `attach` hands both to the run's
`Checkpointer` (a commit hook: `committed` submits, `spared` keeps evaluated steps).
Scripts are written whole (a temporary file renamed) to `lighteval.slurm_script_dir`
(default `<run>/eval_jobs`), the job's log beside them or in `lighteval.logs_path`. The
submission is the only wait (sbatch, at most 60 s); one that fails is one logged line, and
training goes on. The scores stay in the job's files: they reach no metrics file.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from mesh3d.checkpoint.folder import step_folders
from mesh3d.checks.eval_checks import eval_interval, eval_ranks, lm_eval_tasks, sbatch_binary
from mesh3d.log import logger

SBATCH_TIMEOUT_S = 60
# the training ranks' torch.distributed variables, which sbatch would hand to the job
TORCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")  # fmt: skip
SBATCH_FLAGS = (("partition", "partition"), ("qos", "qos"), ("time", "time"),
                ("reservation", "reservation"), ("cpus_per_task", "cpus-per-task"))  # fmt: skip


def attach(cfg, run_dir: Path, checkpoints) -> None:
    """Give the run's `Checkpointer` the jobs of `cfg.lighteval` (every rank calls it)."""
    checkpoints.hooks.append(EvalJobs(cfg, run_dir))  # its hooks run on world rank 0


class EvalJobs:
    """The `lighteval:` section of a run as one sbatch job per evaluated checkpoint."""

    def __init__(self, cfg, run_dir: Path):
        section = cfg.lighteval
        self.cfg, self.section = cfg, section
        self.interval = eval_interval(cfg)
        self.root = Path(cfg.checkpoints.checkpoints_path).absolute()
        self.cwd = Path.cwd()
        logging = section.get("logging") or {}
        self.output = Path(logging.get("local_output_path") or run_dir / "evals").absolute()
        self.scripts = Path(section.get("slurm_script_dir") or run_dir / "eval_jobs").absolute()
        self.logs = Path(section.get("logs_path") or self.scripts).absolute()
        self.slurm = section.get("slurm") or {}
        template = section.get("slurm_template")
        self.template = Path(str(template)).expanduser().read_text() if template else None

    def evaluated(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def spared(self) -> set[int]:
        """The evaluated step folders: read by a job, now or later, so retention keeps them."""
        return {s for s in step_folders(self.root) if self.evaluated(s)}

    def commands(self, step: int) -> list[list[str]]:
        """The `mesh3d eval` command lines of step `step` (one per few-shot count of the lm-eval
        engine's tasks, each to its own output folder when there are several)."""
        s, tasks = self.section, self.section["tasks"]
        dp, tp, pp = eval_ranks(s)
        n = dp * tp * pp
        head = [sys.executable, "-m", "mesh3d.cli", "eval"]
        if n > 1:
            head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={n}", "-m", "mesh3d.cli", "eval"]  # fmt: skip
        common = [str(self.root / str(step)), "--engine", self.cfg.mesh3d.eval_engine,
                  "--batch-size", str(s.get("batch_size") or 8)]  # fmt: skip
        if tasks.get("custom_tasks"):
            common += ["--custom-tasks", str(Path(tasks["custom_tasks"]).absolute())]
        if tasks.get("max_samples"):
            common += ["--max-samples", str(tasks["max_samples"])]
        if n > 1:
            common += ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp)]
        out = self.output / str(step)
        if self.cfg.mesh3d.eval_engine == "lighteval":  # the task strings as Nanotron gives them
            return [[*head, *common, "--tasks", tasks["tasks"], "--output-dir", str(out)]]
        groups: dict[int | None, list[str]] = {}
        for task, shots in lm_eval_tasks(tasks["tasks"]):
            groups.setdefault(shots, []).append(task)
        lines = []
        for shots, names in groups.items():
            line = [*head, *common, "--tasks", ",".join(names)]
            if shots is not None:
                line += ["--num-fewshot", str(shots)]
            where = out if len(groups) == 1 else out / f"{'task' if shots is None else shots}-shot"
            lines.append([*line, "--output-dir", str(where)])
        return lines

    def script(self, step: int) -> str:
        """The job script of step `step`."""
        n = eval_ranks(self.section)
        gpus = self.slurm.get("gpus_per_node") or n[0] * n[1] * n[2]
        run = str(self.cfg.general.run or "run").replace(" ", "_")
        values = {
            "job_name": f"eval_{step}_{run}", "step": str(step),
            "checkpoint": str(self.root / str(step)), "output_dir": str(self.output / str(step)),
            "log_file": str(self.logs / f"eval-step-{step}-%j.out"), "nodes": "1",
            "gpus": str(gpus),
        }  # fmt: skip
        lines = [f"--job-name={values['job_name']}", "--nodes=1", "--ntasks-per-node=1",
                 f"--gpus-per-node={gpus}", f"--output={values['log_file']}"]  # fmt: skip
        lines += [
            f"--{flag}={self.slurm[key]}" for key, flag in SBATCH_FLAGS if self.slurm.get(key)
        ]
        values["sbatch_lines"] = "\n".join(f"#SBATCH {x}" for x in lines)
        body = [f"cd {shlex.quote(str(self.cwd))}", f"unset {' '.join(TORCH_ENV)}"]
        if self.slurm.get("hf_cache"):
            body.append(f"export HF_HOME={shlex.quote(os.path.expanduser(self.slurm['hf_cache']))}")
        values["command"] = "\n".join([*body, *(shlex.join(c) for c in self.commands(step))])
        if self.template is not None:
            return re.sub(r"{{\s*(\w+)\s*}}", lambda m: values[m.group(1)], self.template)
        return (f"#!/bin/bash\n{values['sbatch_lines']}\n# mesh3d: the evaluation of step {step} "
                f"of {self.root} (mesh3d.eval_mode: slurm_job)\nset -eo pipefail\n"
                f"{values['command']}\n")  # fmt: skip

    def write(self, step: int) -> Path:
        """The job script of step `step`, written whole (a temporary file renamed)."""
        self.scripts.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.scripts / f"eval-step-{step}.sbatch"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.script(step))
        os.replace(tmp, path)
        return path

    def committed(self, step_dir: Path) -> str | None:
        """After the commit of `step_dir` (world rank 0): write and submit its job when the step
        is evaluated; the job id, or None (not evaluated, or the one logged line of a failure)."""
        step = int(step_dir.name)
        if not self.evaluated(step):
            return None
        script = None
        try:
            script = self.write(step)
            env = {k: v for k, v in os.environ.items() if k not in TORCH_ENV}
            got = subprocess.run([sbatch_binary() or "sbatch", str(script)], capture_output=True,
                                 text=True, env=env, cwd=self.cwd, timeout=SBATCH_TIMEOUT_S)  # fmt: skip
            if got.returncode != 0:
                lines = (got.stderr or got.stdout).strip().splitlines()
                raise RuntimeError(f"sbatch exit {got.returncode}: {lines[-1] if lines else ''}")
        except Exception as e:  # noqa: BLE001 - one line; training goes on
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            hand = f"; submit it by hand: sbatch {script}" if script else ""
            logger.warning(f"[Eval] step {step}: the evaluation job was not submitted ({why}); "
                           f"training goes on{hand}")  # fmt: skip
            return None
        words = got.stdout.split()
        job = words[-1] if words else "?"
        logger.info(f"[Eval] step {step}: evaluation job {job} submitted ({script}; results to "
                    f"{self.output / str(step)})")  # fmt: skip
        return job
