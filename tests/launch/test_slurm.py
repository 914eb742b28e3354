"""`recipes/slurm/train.sbatch` under a real Slurm: a one-node cluster (slurmctld + slurmd on
this machine, as root) started for the test. The job trains, gets the preemption notice the
way `#SBATCH --signal=B:USR1@180` delivers it (SIGUSR1 to the batch shell), saves, requeues
itself and resumes: its losses equal an uninterrupted run's bitwise.

Skipped where Slurm is not installed (Debian: `apt-get install slurm-wlm`) or cannot start here
(not root, no munge). ~25 s when it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from dist import run_ranks
from launch import REPO, free_port, quiet_env
from parity import TINY, layout_overrides, train_runs

from mesh3d.checkpoint.folder import verify
from mesh3d.config import config_from_dict, save_config

TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "munge", "munged")
DP2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)
STEPS = 200  # ~25 ms each: the notice lands well before the end


def _conf(folder: Path) -> Path:
    host = socket.gethostname()
    body = f"""
ClusterName=mesh3dtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
SlurmUser=root
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=60
MinJobAge=300
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    path = folder / "slurm.conf"
    path.write_text(body.lstrip())
    return path


def _munge_works() -> bool:
    token = subprocess.run(["munge", "-n"], capture_output=True)
    if token.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=token.stdout, capture_output=True).returncode == 0


@pytest.fixture
def slurm(tmp_path):
    """The environment of a client of a fresh one-node cluster; everything is stopped after."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    started_munge = False
    if not _munge_works():
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], capture_output=True)
        started_munge = True
        if not _munge_works():
            pytest.skip("munge, which Slurm authenticates with, does not start here")
    folder = tmp_path / "slurm"
    conf = _conf(folder)
    env = quiet_env(SLURM_CONF=str(conf), PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    daemons = []
    try:
        for daemon in (["slurmctld", "-i"], ["slurmd"]):
            subprocess.run([*daemon, "-f", str(conf)], env=env, check=True, timeout=30)
            daemons.append(folder / f"{daemon[0]}.pid")
        state = _wait_idle(env, timeout=30)
        if state != "idle":
            logs = "".join(p.read_text()[-1500:] for p in folder.glob("*.log"))
            pytest.skip(f"the one-node Slurm cluster did not come up (node {state!r}): {logs}")
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        for pidfile in daemons:
            if pidfile.exists():
                pid = int(pidfile.read_text())
                for child in _descendants(pid):  # job steps a failed test left running would
                    with contextlib.suppress(ProcessLookupError):  # hold the node's CPUs
                        os.kill(child, signal.SIGKILL)
                os.kill(pid, signal.SIGTERM)
        if started_munge and Path("/run/munge/munged.pid").exists():
            os.kill(int(Path("/run/munge/munged.pid").read_text()), signal.SIGTERM)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through `pgrep -P`)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(x) for x in out.split()]
    return [c for child in children for c in (child, *_descendants(child))]


def _job(env: dict, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return out.stdout


def _node_state(env: dict) -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
    return out.stdout.strip()


def _wait_idle(env: dict, timeout: float) -> str:
    """The node's state once it is idle, or the last one seen after `timeout`."""
    deadline = time.monotonic() + timeout
    while (state := _node_state(env)) != "idle" and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def _wait_state(env: dict, job: str, state: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while f"JobState={state}" not in _job(env, job):
        assert time.monotonic() < deadline, _job(env, job)
        time.sleep(0.2)


def _start_again(env: dict, job: str, tries: int = 3) -> None:
    """Start the requeued `job` now and wait until it completed. A start that failed before the
    batch script ran (FAILED with RunTime 00:00:00: slurmd was still cleaning up the job's
    previous run, seen once in a full run) is requeued and started again; any other failure
    fails the test."""
    for _ in range(tries):
        _wait_idle(env, timeout=60)
        info = _job(env, job)
        if "JobState=FAILED" not in info:
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=env,
                           check=True)  # fmt: skip
            deadline = time.monotonic() + 180
            while not any(f"JobState={s}" in (info := _job(env, job))
                          for s in ("COMPLETED", "FAILED")):  # fmt: skip
                assert time.monotonic() < deadline, info
                time.sleep(0.2)
            if "JobState=COMPLETED" in info:
                return
        assert "RunTime=00:00:00" in info, info  # it ran and failed: a real failure
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        _wait_state(env, job, "PENDING", timeout=60)
    raise AssertionError(f"job {job} could not be started again: {_job(env, job)}")


def test_sbatch_recipe_saves_on_the_notice_requeues_and_resumes_bitwise(slurm, tmp_path):
    cfg, root, metrics = tmp_path / "tiny.yaml", tmp_path / "ck", tmp_path / "metrics.jsonl"
    save_config(config_from_dict(TINY), cfg)
    log = tmp_path / "job.out"
    overrides = [*DP2, f"tokens.train_steps={STEPS}", f"checkpoints.checkpoints_path={root}",
                 "checkpoints.checkpoint_interval=1000", "mesh3d.collective_timeout_s=20",
                 "logging.log_level=info", "--rdzv-port", str(free_port()),
                 "--metrics-file", str(metrics)]  # fmt: skip
    # --gpus-per-node=0: this node has no GPUs; GPUS_PER_NODE: ranks per node (2 CPU ranks)
    submit = ["sbatch", "--parsable", "--gpus-per-node=0", f"--output={log}", f"--chdir={REPO}",
              str(REPO / "recipes" / "slurm" / "train.sbatch"), str(cfg), *overrides]  # fmt: skip
    job = subprocess.run(submit, env={**slurm, "GPUS_PER_NODE": "2"}, capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert time.monotonic() < deadline, (
            log.read_text()[-3000:] if log.exists() else _job(slurm, job)
        )
        time.sleep(0.05)
    # what `--signal=B:USR1@180` does before the time limit: SIGUSR1 to the batch shell
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    _wait_state(slurm, job, "PENDING", timeout=120)  # requeued by the script
    out = log.read_text()
    saved = re.search(
        rf"preempted: SIGUSR1 received: stopped after step (\d+) and saved {root}/", out
    )
    assert saved and "Restarts=1" in _job(slurm, job), out[-3000:]
    step = int(saved.group(1))
    assert (root / "latest.txt").read_text() == str(step) and verify(root / str(step)) == []
    # Slurm holds a requeued job back for two minutes; let it start now, once the node has
    # finished with its first run (slurmd refuses to start a job id it is still cleaning up)
    _wait_idle(slurm, timeout=60)
    _start_again(slurm, job)
    out = log.read_text()
    assert f"Resumed from {root} at step {step}" in out, out[-3000:]
    losses = [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]
    (straight,) = run_ranks(2, train_runs, [DP2 + [f"tokens.train_steps={STEPS}"]], timeout=120)[0]
    assert losses == straight["loss"]
