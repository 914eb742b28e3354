"""The fault suite, part 2 (real processes): stopped ranks, preemption signals, a killed
launcher, a full disk, two runs on one folder. Each test reproduces one row of the table in
docs/faults.md with `recipes/train.py` as users start it, and asserts the time to exit, the
message and what is left on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist import run_ranks
from launch import REPO, TRAIN, Ranks, alive, children, preempt_and_resume, quiet_env
from parity import TINY, layout_overrides, train_runs

from mesh3d.checkpoint.folder import verify
from mesh3d.checkpoint.lock import LOCK
from mesh3d.config import config_from_dict, save_config

TIMEOUT = ["mesh3d.collective_timeout_s=4", "mesh3d.checkpoint_timeout_s=30"]
DP2 = layout_overrides(2, 1, "ALL_REDUCE", 0, False)


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    save_config(config_from_dict(TINY), path)
    return path


def _args(cfg: Path, *overrides: str) -> list[str]:
    return ["--config-file", str(cfg), "logging.log_level=info", *overrides]


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_stopped_or_dead_rank_ends_the_job_within_the_timeout_and_is_named(
    tiny_yaml, tmp_path, sig
):
    """`kill -STOP` of one rank: no output for 1,832 s, then a timeout blaming rank 0. Now the
    job ends after the collective timeout (4 s here) and names rank 1 and its last step."""
    args = _args(tiny_yaml, *DP2, *TIMEOUT, "tokens.train_steps=400")
    with Ranks(2, args, tmp_path) as ranks:
        ranks.wait_for(r"iteration: 3 / 400")
        ranks.send(1, sig)
        sent = time.monotonic()
        codes = ranks.wait(timeout=60)
        took = time.monotonic() - sent
    out = ranks.output(0)
    assert codes == [4, -signal.SIGKILL], out[-2000:]  # a stopped rank is ended by rank 0
    print(f"rank 1 {signal.Signals(sig).name}: the job ended {took:.1f} s later (timeout 4 s)")
    assert took < 4 + 10, took  # the collective timeout, plus diagnosis and exit
    line = next(x for x in out.splitlines() if x.startswith("error:"))
    cause = "Timed out" if sig == signal.SIGSTOP else "Connection (closed|reset)"
    failed = re.search(rf"a collective failed at step (\d+) \(step\): .*{cause}", line)
    assert failed, line
    pattern = r"rank 1 \(host .*, pid \d+\) last reported step (\d+) \(step\) \d+ s ago: its (heartbeat stopped|process is gone)"
    found = re.search(pattern, line)
    # The heartbeat thread publishes at most 20 times a second, and this model's steps take a few
    # milliseconds: the step it names may trail the one rank 1 stopped in, never lead it.
    assert found and 1 <= int(found.group(1)) <= int(failed.group(1)), line
    assert ("Sent SIGKILL to the stopped rank 1" in line) == (sig == signal.SIGSTOP)


def test_sigterm_to_torchrun_saves_and_the_same_command_resumes_exactly(tiny_yaml, tmp_path):
    """SIGTERM to the launcher (Slurm's preemption notice): exit in 0.6 s, no checkpoint, work
    lost. Now every rank finishes the step, saves it, exits 75; the same command resumes."""
    root = tmp_path / "ck"
    overrides = [*DP2, *TIMEOUT, "tokens.train_steps=12", f"checkpoints.checkpoints_path={root}",
                 "checkpoints.checkpoint_interval=100", f"checkpoints.resume_checkpoint_path={root}"]  # fmt: skip

    def launch(metrics: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(TRAIN), "--metrics-file", str(metrics), *_args(tiny_yaml, *overrides)]  # fmt: skip
        return subprocess.Popen(cmd, cwd=REPO, env=quiet_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    first, out, done, both, out2 = preempt_and_resume(launch, signal.SIGTERM, tmp_path)
    assert f"preempted: SIGTERM received: stopped after step {done} and saved {root}/{done}" in out
    assert first.returncode == 1, out[-3000:]  # torchrun's own code after a signal
    assert (root / "latest.txt").read_text() == str(done) and verify(root / str(done)) == []
    assert f"Resumed from {root} at step {done}" in out2
    (straight,) = run_ranks(2, train_runs, [DP2 + ["tokens.train_steps=12"]], timeout=120)[0]
    assert both == straight["loss"]


def test_ranks_stop_when_their_launcher_is_killed(tiny_yaml, tmp_path):
    """`kill -9` of torchrun: the 4 ranks trained and saved to the end on their own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(TRAIN), *_args(tiny_yaml, *DP2, *TIMEOUT, "tokens.train_steps=400")]  # fmt: skip
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=quiet_env(), stdout=out, stderr=out)
    try:
        while "iteration: 2 / 400" not in log.read_text():
            assert launcher.poll() is None, log.read_text()
            time.sleep(0.1)
        workers = children(launcher.pid)
        assert len(workers) == 2
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while any(alive(w) for w in workers) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        took = time.monotonic() - killed
    finally:
        for w in children(launcher.pid) + [launcher.pid]:
            with contextlib.suppress(OSError):
                os.kill(w, signal.SIGKILL)
    print(f"launcher killed: its ranks ended {took:.1f} s later")
    assert not any(alive(w) for w in workers) and took < 5, took
    assert f"the launcher (pid {launcher.pid}) is gone, so this rank stops" in log.read_text()


def test_two_runs_on_one_folder_and_a_single_process_preemption(tiny_yaml, tmp_path):
    """Two runs with one checkpoints_path: both saved into it, one crashed on the other's .tmp.
    Now the second fails at start with one line; the first, sent SIGTERM, saves and exits 75."""
    root = tmp_path / "ck"
    args = _args(tiny_yaml, "tokens.train_steps=400", f"checkpoints.checkpoints_path={root}",
                 "checkpoints.checkpoint_interval=1000")  # fmt: skip
    with Ranks(1, args, tmp_path / "a") as first:
        first.wait_for(r"iteration: 2 / 400")
        second = subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, env=quiet_env(),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2
        errors = [x for x in second.stderr.splitlines() if x.startswith("error:")]
        assert (
            len(errors) == 1 and f"checkpoints folder {root} is in use by another run" in errors[0]
        )
        first.send(0, signal.SIGTERM)
        (code,) = first.wait(timeout=60)
    assert code == 75, first.output()[-2000:]
    step = int(re.search(r"stopped after step (\d+)", first.output()).group(1))
    assert sorted(p.name for p in root.iterdir()) == sorted([str(step), "latest.txt"])  # no lock
    assert verify(root / str(step)) == []


def _tmpfs_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = "mkdir -p /tmp/mesh3d-tmpfs-probe && mount -t tmpfs -o size=1M tmpfs /tmp/mesh3d-tmpfs-probe"
    return (
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(
    not _tmpfs_works(), reason="needs a small tmpfs: `unshare -rm` + mount not permitted here"
)
def test_full_disk_refuses_the_save_and_keeps_the_previous_checkpoint(tiny_yaml, tmp_path):
    """Disk full during a save: iostream errors on every rank, .tmp-N left, the disk stays full.
    On a 2 MiB tmpfs, the step-2 checkpoint (~1.3 MiB) fits and the step-4 one does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = _args(tiny_yaml, "tokens.train_steps=6", f"checkpoints.checkpoints_path={disk}/ck",
                 "checkpoints.checkpoint_interval=2")  # fmt: skip
    script = (f"mount -t tmpfs -o size=2m tmpfs {disk} && {sys.executable} {TRAIN} "
              + " ".join(args) + f"; code=$?; cp -r {disk}/ck {tmp_path}/after; exit $code")  # fmt: skip
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=quiet_env(),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert run.returncode == 5, run.stdout[-2000:] + run.stderr[-2000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    assert re.search(
        rf"not enough space for the checkpoint of step 4 in {disk}/ck: it needs about [\d.]+ MiB, [\d.]+ KiB are free; the last complete checkpoint is {disk}/ck/2",
        line,
    ), line
    after = tmp_path / "after"
    assert sorted(p.name for p in after.iterdir()) == ["2", "latest.txt"]  # no .tmp-4, no lock
    assert verify(after / "2") == []
    assert not (after / LOCK).exists()


def test_refusals_are_said_once_before_any_model_is_built_and_exits_are_not_deaths(
    tiny_yaml, tmp_path
):
    """Four smaller faults, launched side by side: a config mistake on 2 ranks was printed by
    each rank; a folder held by another run was refused only after the model was built (61-72 s
    at 4 ranks); `existing_checkpoints: resume` on an empty folder said nothing; a peer that
    ended its run (here with an error) was reported as gone."""
    import socket

    held = tmp_path / "held"
    held.mkdir()
    (held / LOCK).write_text(json.dumps({"run_id": "other", "host": socket.gethostname(),
                                         "pid": os.getpid(), "started": "x"}))  # fmt: skip
    fresh = tmp_path / "fresh"
    folder = ["checkpoints.checkpoint_interval=10", "mesh3d.existing_checkpoints=resume"]
    cases = {  # name: (ranks, overrides, environment)
        "config": (2, [*DP2, "tokens.micro_batch_size=0"], {}),
        "typo": (2, [*DP2, "tokens.micro_batchsize=2"], {}),
        "lock": (2, [*DP2, f"checkpoints.checkpoints_path={held}", *folder], {}),
        "resume": (
            1,
            ["tokens.train_steps=2", f"checkpoints.checkpoints_path={fresh}", *folder],
            {},
        ),
        "exited": (2, [*DP2, *TIMEOUT, "tokens.train_steps=400"], {"MESH3D_FAIL_AT": "1:3"}),
    }
    launches = {name: Ranks(n, _args(tiny_yaml, *overrides), tmp_path / name, env=env)
                for name, (n, overrides, env) in cases.items()}  # fmt: skip
    codes = {name: ranks.wait(timeout=120) for name, ranks in launches.items()}
    outs = {
        name: [ranks.output(r) for r in range(len(ranks.procs))] for name, ranks in launches.items()
    }

    def errors(name: str) -> list[list[str]]:
        return [[x for x in out.splitlines() if x.startswith("error:")] for out in outs[name]]

    for name, fragment in (("config", "`tokens.micro_batch_size` must be >= 1, got 0"),
                           ("typo", "unknown key `tokens.micro_batchsize`"),
                           ("lock", f"checkpoints folder {held} is in use by another run")):  # fmt: skip
        assert codes[name] == [2, 2], outs[name]
        (rank0,), rank1 = errors(name)
        assert fragment in rank0 and rank1 == [], outs[name]  # once, by rank 0
    assert not any("Total number of parameters" in out for out in outs["lock"])  # no model built
    assert codes["resume"] == [0], outs["resume"]
    assert (
        f"mesh3d.existing_checkpoints=resume: no checkpoint in {fresh} yet: starting fresh"
        in outs["resume"][0]
    )
    assert codes["exited"][0] == 4, outs["exited"][0][-3000:]
    (line,) = errors("exited")[0]
    assert re.search(
        r"rank 1 \(host .*, pid \d+\) at step 3: it ended its run: RuntimeError: MESH3D_FAIL_AT: "
        "injected failure on rank 1 at step 3",
        line,
    ), line
    assert "is gone" not in line and "heartbeat stopped" not in line, line


def test_a_suspended_run_keeps_its_folder(tiny_yaml, tmp_path):
    """A run stopped (SIGSTOP, what `scontrol suspend` does) for over 60 s: its lock counted as
    stale, a second run took the folder, and after SIGCONT both wrote steps into it and exited
    0. A live owner on the same host is never stale now: the second run is refused."""
    root = tmp_path / "ck"
    args = _args(tiny_yaml, "tokens.train_steps=200", f"checkpoints.checkpoints_path={root}",
                 "checkpoints.checkpoint_interval=100", "mesh3d.existing_checkpoints=resume")  # fmt: skip
    with Ranks(1, args, tmp_path / "a") as first:
        first.wait_for(r"iteration: 2 / 200")
        first.send(0, signal.SIGSTOP)
        old = time.time() - 75  # 75 s without a refresh, as after `scontrol suspend`
        os.utime(root / LOCK, (old, old))
        second = subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, env=quiet_env(),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        first.send(0, signal.SIGCONT)
        (code,) = first.wait(timeout=120)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    (line,) = [x for x in second.stderr.splitlines() if x.startswith("error:")]
    assert f"checkpoints folder {root} is in use by another run" in line
    found = re.search(rf"pid {first.procs[0].pid}, .*; lock refreshed (\d+) s ago\)", line)
    assert found and int(found.group(1)) >= 75, (first.procs[0].pid, line)
    assert code == 0, first.output()[-2000:]
    assert sorted(p.name for p in root.iterdir()) == ["100", "200", "latest.txt"]


def test_a_rank_that_never_arrives_is_named_within_the_timeout(tiny_yaml, tmp_path):
    """A rank stopped before the process group was up: the job ended after 182 s with a raw
    gloo traceback naming nobody (at a 4 s timeout: a store traceback, exit 1). Now the
    rendezvous is bounded by mesh3d.collective_timeout_s and the others say who never came."""
    args = _args(tiny_yaml, *DP2, *TIMEOUT)
    runs = {stopped: Ranks(2, args, tmp_path / f"stop{stopped}") for stopped in (0, 1)}
    for stopped, ranks in runs.items():
        ranks.send(stopped, signal.SIGSTOP)  # still starting python
    started = time.monotonic()
    codes = {stopped: ranks.procs[1 - stopped].wait(timeout=90) for stopped, ranks in runs.items()}
    took = time.monotonic() - started
    for ranks in runs.values():
        ranks.kill()
    print(f"a rank stopped at start: the other ended {took:.1f} s later (timeout 4 s)")
    ranks = runs[1]
    assert codes[1] == 4, ranks.output(0)[-3000:]
    (line,) = [x for x in ranks.output(0).splitlines() if x.startswith("error:")]
    assert re.fullmatch(
        r"error: \[rank 0\] rendezvous: rank\(s\) 1 of 2 did not arrive within "
        r"mesh3d.collective_timeout_s \(4 s\): stopped, dead, still starting, or never launched. "
        r"Arrived: rank 0 \(host .+, pid \d+\). .*",
        line,
    ), line
    ranks = runs[0]
    assert codes[0] == 4, ranks.output(1)[-3000:]
    (line,) = [x for x in ranks.output(1).splitlines() if x.startswith("error:")]
    assert re.match(
        r"error: \[rank 1\] rendezvous: the store at 127.0.0.1:\d+, hosted by rank 0, did not "
        r"answer within mesh3d.collective_timeout_s \(4 s\)",
        line,
    ), line
    assert "Traceback" not in runs[0].output(1) + runs[1].output(0)
    assert took < 40, took  # start-up (both launches side by side on 2 cores) + 4 s + exit
