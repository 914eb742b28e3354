"""`mesh3d.eval_mode: slurm_job`: an sbatch job per evaluated checkpoint instead of in-run scores.

A fake `sbatch` on PATH records its argv and runs the job script with bash (synchronously, for
the step named by $FAKE_SBATCH_RUN; the others only queued), with the environment the training
rank hands it. A tiny Llama trains 4 steps, saving every step and keeping the last one
(`mesh3d.keep_last_checkpoints: 1`), evaluated every 2 steps, and the same run without a
`lighteval:` section: the two train bitwise alike; the scripts of steps 2 and 4 hold the
`#SBATCH` lines of `lighteval.slurm` and the `mesh3d eval` command; retention kept the folders
the jobs read (2 and 4, not 1 and 3); the step-4 job wrote the same scores as `mesh3d eval` on
that checkpoint. An sbatch that fails is one logged line, and training goes on.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install 'mesh3d[eval]'"
)

from dist import run_ranks  # noqa: E402
from eval_fixtures import SEQ, TASKS, train_config, write_tasks  # noqa: E402
from parity import full_weights  # noqa: E402

from mesh3d.train.hooks import BatchHashes, KeepModel  # noqa: E402
from mesh3d.train.loop import train  # noqa: E402

FAKE_SBATCH = """#!/bin/bash
echo "$@" >> "$(dirname "$0")/argv.log"
case "$1" in $FAKE_SBATCH_RUN) bash "$1" > "$1.ran" 2>&1 || echo "job failed" >> "$1.ran";; esac
echo "Submitted batch job 4242"
"""
FAILING_SBATCH = """#!/bin/bash
echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
exit 1
"""
SLURM = "{partition: evals, qos: low, time: '01:00:00', cpus_per_task: 4, hf_cache: /tmp/hfc}"


def _executable(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _runs(rank: int, world: int, root) -> list[dict]:
    os.environ["PATH"] = f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}"
    os.environ["FAKE_SBATCH_RUN"] = "*eval-step-4.sbatch"
    lighteval = (f"lighteval={{batch_size: 4, eval_interval: 2, slurm: {SLURM}, "
                 f"tasks: {{tasks: '{','.join(TASKS)}', custom_tasks: {root / 'tasks'}}}, "
                 f"logging: {{local_output_path: {root / 'evals'}}}}}")  # fmt: skip
    keep = ["checkpoints.checkpoint_interval=1", "mesh3d.keep_last_checkpoints=1"]
    out = []
    for name, extra in (("with", [lighteval, "mesh3d.eval_mode=slurm_job"]), ("without", [])):
        cfg = train_config(root / name, steps=4, extra=[*keep, *extra])
        hashes = BatchHashes()
        res = train(cfg, str(root / name / "metrics.jsonl"), hooks=[hashes, KeepModel()])
        out.append({"loss": [m["lm_loss"] for m in res.metrics], "hashes": hashes.hashes,
                    "weights": full_weights(res.model, res.mesh), "evals": res.evals})  # fmt: skip
    return out


def _failing(rank: int, world: int, root) -> dict:
    os.environ["MESH3D_SBATCH"] = str(_executable(root / "failbin" / "sbatch", FAILING_SBATCH))
    lighteval = f"lighteval={{tasks: {{tasks: tiny_mc, custom_tasks: {root / 'tasks'}}}}}"
    cfg = train_config(root / "failing", steps=2, extra=[
        "checkpoints.checkpoint_interval=1", lighteval, "mesh3d.eval_mode=slurm_job"])  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the run's logger writes to stdout
        res = train(cfg)
    return {"steps": len(res.metrics), "log": printed.getvalue()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sbatch")
    write_tasks(root)
    _executable(root / "bin" / "sbatch", FAKE_SBATCH)
    for name in ("with", "without", "failing"):
        (root / name).mkdir()
        (root / name / "tok").symlink_to(root / "tok")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with_, without = run_ranks(1, _runs, root, timeout=300)[0]
    failing = run_ranks(1, _failing, root, timeout=120)[0]
    return {"with": with_, "without": without, "failing": failing, "root": root}


def test_a_run_that_submits_evaluation_jobs_trains_bitwise_like_one_without(runs):
    with_, without = runs["with"], runs["without"]
    assert with_["loss"] == without["loss"] and with_["hashes"] == without["hashes"]
    w, wo = with_["weights"], without["weights"]
    assert w.keys() == wo.keys() and all((w[k] == wo[k]).all() for k in w)
    assert with_["evals"] == []  # the scores are the jobs'


def test_the_scripts_hold_the_slurm_keys_and_the_mesh3d_eval_command(runs):
    root = runs["root"]
    jobs = root / "with" / "eval_jobs"
    argv = (root / "bin" / "argv.log").read_text().splitlines()
    assert argv == [str(jobs / "eval-step-2.sbatch"), str(jobs / "eval-step-4.sbatch")]
    script = (jobs / "eval-step-4.sbatch").read_text()
    sbatch = [x for x in script.splitlines() if x.startswith("#SBATCH")]
    for line in ("--partition=evals", "--qos=low", "--time=01:00:00", "--cpus-per-task=4",
                 "--nodes=1", "--gpus-per-node=1", f"--output={jobs}/eval-step-4-%j.out"):  # fmt: skip
        assert f"#SBATCH {line}" in sbatch, script
    assert not any("reservation" in x for x in sbatch)  # written only when given
    assert "export HF_HOME=/tmp/hfc" in script and "unset RANK " in script
    command = [x for x in script.splitlines() if "mesh3d.cli eval" in x]
    assert command == [
        f"{sys.executable} -m mesh3d.cli eval {root / 'with' / 'ck' / '4'} --engine lm-eval "
        f"--batch-size 4 --custom-tasks {root / 'tasks'} --tasks {','.join(TASKS)} "
        f"--output-dir {root / 'evals' / '4'}"
    ], script
    assert not list(jobs.glob(".*.tmp"))  # written whole


def test_retention_keeps_the_folders_the_jobs_read(runs):
    ck = runs["root"] / "with" / "ck"
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [2, 4]
    assert sorted(
        p.name for p in (runs["root"] / "without" / "ck").iterdir() if p.name.isdigit()
    ) == ["4"]


def test_the_job_writes_the_scores_of_mesh3d_eval_on_the_checkpoint(runs):
    root = runs["root"]
    ran = (root / "with" / "eval_jobs" / "eval-step-4.sbatch.ran").read_text()
    assert "job failed" not in ran, ran
    ref = root / "ref"
    cmd = [sys.executable, "-m", "mesh3d.cli", "eval", str(root / "with" / "ck" / "4"), "--tasks",
           ",".join(TASKS), "--custom-tasks", str(root / "tasks"), "--batch-size", "4",
           "--output-dir", str(ref), "--max-length", str(SEQ)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    job = json.loads((root / "evals" / "4" / "results.json").read_text())
    want = json.loads((ref / "results.json").read_text())
    assert job["results"] == want["results"] and set(job["results"]) == set(TASKS)


def test_a_failed_submission_is_one_line_and_training_goes_on(runs):
    failing = runs["failing"]
    assert failing["steps"] == 2
    lines = [x for x in failing["log"].splitlines() if "not submitted" in x]
    assert len(lines) == 2, failing["log"]
    assert "[Eval] step 1: the evaluation job was not submitted (RuntimeError: sbatch exit 1: " \
           "sbatch: error: Batch job submission failed: Invalid partition name specified); " \
           "training goes on; submit it by hand: sbatch " in lines[0]  # fmt: skip
