"""The job scripts of `mesh3d.eval_mode: slurm_job` built without a run: a multi-rank layout under
torchrun, few-shot groups, a `slurm_template`, and the step folders retention must keep
(the launch tests, with a fake sbatch and a real run: `tests/launch/test_eval_slurm_job.py`)."""

from __future__ import annotations

import sys

from eval_fixtures import train_config

from mesh3d.checks.eval_checks import eval_errors
from mesh3d.evaluation.slurm_job import EvalJobs

TEMPLATE = "#!/bin/bash\n{{ sbatch_lines }}\n#SBATCH --account=mine\necho {{ step }} {{job_name}}\n{{ command }}\n"


def _jobs(tmp_path, **section):
    lighteval = {"tasks": {"tasks": "lighteval|hellaswag|0|1,lighteval|arc:easy|5|1,piqa"},
                 "parallelism": {"dp": 1, "tp": 2, "pp": 2}, **section}  # fmt: skip
    cfg = train_config(tmp_path, extra=["mesh3d.eval_mode=slurm_job", "checkpoints.checkpoint_interval=2",
                                        "general.run=my run"])  # fmt: skip
    cfg.lighteval = lighteval
    return cfg, EvalJobs(cfg, tmp_path)


def test_several_ranks_run_under_torchrun_one_line_per_few_shot_count(tmp_path):
    _, jobs = _jobs(tmp_path)
    lines = jobs.commands(4)
    assert len(lines) == 3  # 0-shot, 5-shot, the task's own
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
            "-m", "mesh3d.cli", "eval", str(tmp_path / "ck" / "4")]  # fmt: skip
    assert all(line[: len(head)] == head for line in lines)
    first = lines[0]
    assert first[first.index("--tasks") + 1] == "hellaswag" and "--num-fewshot" in first
    assert lines[1][lines[1].index("--tasks") + 1] == "arc_easy"
    assert lines[1][-1] == str(tmp_path / "evals" / "4" / "5-shot")
    assert "--num-fewshot" not in lines[2] and lines[2][-1].endswith("task-shot")
    at = first.index("--dp")
    assert first[at : at + 6] == ["--dp", "1", "--tp", "2", "--pp", "2"]
    script = jobs.script(4)
    assert "#SBATCH --gpus-per-node=4" in script and "#SBATCH --job-name=eval_4_my_run" in script


def test_a_slurm_template_is_filled_in(tmp_path):
    (tmp_path / "t.sbatch").write_text(TEMPLATE)
    cfg, jobs = _jobs(tmp_path, slurm_template=str(tmp_path / "t.sbatch"))
    assert not [e for e in eval_errors(cfg) if "slurm_template" in e]
    script = jobs.script(6)
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=eval_6_my_run\n")
    assert "#SBATCH --account=mine\necho 6 eval_6_my_run\n" in script
    assert "-m mesh3d.cli eval" in script and "{{" not in script
    path = jobs.write(6)
    assert path.read_text() == script and path.name == "eval-step-6.sbatch"


def test_an_unknown_placeholder_is_refused(tmp_path):
    (tmp_path / "t.sbatch").write_text("{{ command }} {{ nodez }}")
    cfg, _ = _jobs(tmp_path, slurm_template=str(tmp_path / "t.sbatch"))
    errors = [e for e in eval_errors(cfg) if "slurm_template" in e]
    assert len(errors) == 1 and "'nodez'" in errors[0], errors


def test_retention_keeps_the_evaluated_step_folders(tmp_path):
    _, jobs = _jobs(tmp_path)
    for step in (0, 1, 2, 3, 4):
        (tmp_path / "ck" / str(step)).mkdir(parents=True)
        (tmp_path / "ck" / str(step) / "checkpoint_metadata.json").write_text("{}")
    assert jobs.spared() == {2, 4}
