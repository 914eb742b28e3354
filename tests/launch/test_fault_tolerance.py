"""Fault tolerance across replica groups (`mesh3d.fault_tolerance`, torchft), with real
processes: a torchft lighthouse in the test process and each replica group its own job of
`recipes/train.py` ranks (`launch.Ranks`), as `recipes/fault_tolerance/run_local.py` starts them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from launch import REPO, Ranks, free_port, losses
from safetensors.torch import load_file

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'mesh3d[ft]')")
os.environ.setdefault("RUST_LOG", "warn")  # before torchft's servers start: no per-quorum lines
from torchft.coordination import LighthouseServer  # noqa: E402

CFG = REPO / "recipes" / "configs" / "cpu_tiny.yaml"
SMALL = ["model.model_config.hidden_size=64", "model.model_config.intermediate_size=128",
         "model.model_config.num_hidden_layers=2", "logging.log_level=info"]  # fmt: skip


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=1000)  # fmt: skip
    yield server.address()
    server.shutdown()


def _group(g: int, world: int, folder: Path, lighthouse: str, *overrides: str, tag: str = "",
           groups: int = 2, env: dict | None = None):  # fmt: skip
    args = ["--config-file", str(CFG), *SMALL, f"mesh3d.fault_tolerance.lighthouse={lighthouse}",
            f"mesh3d.fault_tolerance.replica_groups={groups}", f"mesh3d.fault_tolerance.replica_id={g}",
            "mesh3d.fault_tolerance.quorum_timeout_s=20", "mesh3d.fault_tolerance.timeout_s=20",
            *overrides, "--metrics-file", str(folder / f"m{g}{tag}.jsonl")]  # fmt: skip
    return Ranks(world, args, folder / f"g{g}{tag}", env=env)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _files_equal(a: Path, b: Path, under: str) -> int:
    """Every file under `a/under` equals its twin under `b` (tensors bitwise); returns the count."""
    n = 0
    for f in sorted((a / under).rglob("*")):
        if f.is_dir():
            continue
        g = b / f.relative_to(a)
        if f.suffix == ".safetensors":
            x, y = load_file(f), load_file(g)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f
        elif f.suffix == ".pt":
            x, y = torch.load(f, weights_only=False), torch.load(g, weights_only=False)
            assert _same(x, y), f  # optimizer / LR-scheduler states
        else:
            assert f.read_bytes() == g.read_bytes(), f
        n += 1
    assert n, f"no files under {a / under}"
    return n


def _same(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.is_tensor(y) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return x == y


def test_two_groups_train_as_one_job_at_dp2_and_resume_with_fault_tolerance_off(
    lighthouse, tmp_path
):
    """No fault: 2 groups of 1 rank equal one job at dp 2 bitwise (each group reads its dp slot
    of the dp-2 run); a group's checkpoint resumes at dp 2 with fault tolerance off."""
    ck = ["tokens.train_steps=8", "checkpoints.checkpoint_interval=4",
          f"checkpoints.checkpoints_path={tmp_path / 'ck'}"]  # fmt: skip
    groups = [_group(g, 1, tmp_path, lighthouse, *ck) for g in range(2)]
    plain_ck = tmp_path / "plain"
    plain = Ranks(2, ["--config-file", str(CFG), *SMALL, "parallelism.dp=2", "tokens.train_steps=8",
                      "checkpoints.checkpoint_interval=8", f"checkpoints.checkpoints_path={plain_ck}",
                      "--metrics-file", str(tmp_path / "plain.jsonl")], tmp_path / "p")  # fmt: skip
    codes = [g.wait(timeout=180) for g in groups] + [plain.wait(timeout=180)]
    assert codes == [[0], [0], [0, 0]], [g.output()[-2000:] for g in groups]
    straight = _metrics(tmp_path / "plain.jsonl")
    for g in range(2):
        got = _metrics(tmp_path / f"m{g}.jsonl")
        assert [m["lm_loss"] for m in got] == [m["lm_loss"] for m in straight]
        assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in straight]
        assert {m["ft_replicas"] for m in got} == {2} and {m["ft_samples"] for m in got} == {32}
    n = _files_equal(tmp_path / "ck" / "replica_0" / "8", plain_ck / "8", "model")
    _files_equal(
        tmp_path / "ck" / "replica_0" / "8", tmp_path / "ck" / "replica_1" / "8", "optimizer"
    )
    print(
        f"2 groups x 1 rank = one job at dp 2: 8 losses and grad norms equal, {n} weight files bitwise"
    )
    # the group's step-4 checkpoint, resumed by a job at dp 2 without fault tolerance
    resumed = Ranks(2, ["--config-file", str(CFG), *SMALL, "parallelism.dp=2", "tokens.train_steps=8",
                        f"checkpoints.resume_checkpoint_path={tmp_path / 'ck' / 'replica_0' / '4'}",
                        f"checkpoints.checkpoints_path={tmp_path / 'off'}", "checkpoints.checkpoint_interval=8",
                        "--metrics-file", str(tmp_path / "off.jsonl")], tmp_path / "o")  # fmt: skip
    assert resumed.wait(timeout=180) == [0, 0], resumed.output()[-2000:]
    assert losses(tmp_path / "off.jsonl") == [m["lm_loss"] for m in straight[4:]]
    _files_equal(tmp_path / "off" / "8", plain_ck / "8", "model")


def test_a_killed_group_rejoins_and_every_replica_ends_bitwise_identical(lighthouse, tmp_path):
    """Two groups of 2 ranks (tp 2): `kill -9` of group 1 at step 8. Group 0 trains on alone
    with no gap longer than the quorum timeout; group 1, started again with the same command,
    heals from group 0 (no checkpoint read) and from then on both hold the same weights and
    optimizer state, bit for bit, up to the final checkpoints."""
    steps = 100
    args = [f"tokens.train_steps={steps}", f"checkpoints.checkpoint_interval={steps}",
            f"checkpoints.checkpoints_path={tmp_path / 'ck'}", "parallelism.tp=2",
            "mesh3d.existing_checkpoints=resume"]  # fmt: skip
    a, b = _group(0, 2, tmp_path, lighthouse, *args), _group(1, 2, tmp_path, lighthouse, *args)
    while len(losses(tmp_path / "m1.jsonl")) < 8:
        assert b.procs[0].poll() is None and a.procs[0].poll() is None, b.output()[-2000:]
        time.sleep(0.05)
    for p in b.procs:
        p.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for p in b.procs:
        p.wait()
    at_kill = len(losses(tmp_path / "m0.jsonl"))
    b2 = _group(1, 2, tmp_path, lighthouse, *args, tag="r")
    codes = [a.wait(timeout=300), b2.wait(timeout=300)]
    out_a, out_b = a.output(), b2.output()
    assert codes == [[0, 0], [0, 0]], (out_a[-2000:], out_b[-2000:])
    assert at_kill < steps // 2, "group 0 ran ahead of the test; lower the model size"
    ma = _metrics(tmp_path / "m0.jsonl")
    assert [m["iteration"] for m in ma] == list(range(1, steps + 1))
    alone = [m["iteration"] for m in ma if m["ft_replicas"] == 1]
    assert alone and alone == list(range(alone[0], alone[-1] + 1)), alone
    gap = max(m["elapsed_time_per_iteration_ms"] for m in ma) / 1000
    assert gap < 20, gap  # never longer than the quorum timeout
    healed = re.search(r"replica group 1 healed from a live peer: at step (\d+)", out_b)
    assert healed, out_b[-3000:]
    joined = int(healed.group(1)) + 1
    assert joined == alone[-1] + 1  # group 0 trains with it from that step on
    mb = _metrics(tmp_path / "m1r.jsonl")
    assert mb[0]["iteration"] == joined and mb[-1]["iteration"] == steps
    # Whether a step of group 0's was in flight at the kill is timing: killed between two
    # all-reduces, group 1 is simply left out of the next quorum. A voided step is trained again
    # alone (the iterations above are contiguous); the donor test below always voids one.
    voided = [int(s) for s in re.findall(r"\[FT\] step (\d+) was not applied", out_a)]
    assert all(s in alone for s in voided), (voided, alone)
    rejoin_s = time.monotonic() - killed
    final = [tmp_path / "ck" / f"replica_{g}" / str(steps) for g in range(2)]
    n = sum(_files_equal(*final, under) for under in ("model", "optimizer", "lr_scheduler"))
    print(f"group 1 killed after step {at_kill} of group 0; group 0 trained alone for steps "
          f"{alone[0]}-{alone[-1]} ({len(voided)} step(s) voided; longest step {gap:.2f} s); group 1 rejoined at step {joined}; "
          f"{n} checkpoint files bitwise identical ({rejoin_s:.0f} s from the kill to the end)")  # fmt: skip


def test_a_donor_that_dies_while_a_group_heals_is_survived(lighthouse, tmp_path):
    """Three groups of one rank; group 1 killed after step 5 and started again; group 0, the
    first donor torchft picks, dies as the healing group asks for its state
    (MESH3D_FT_DIE_SENDING). The healing group's attempt fails, the live group's step in flight
    is voided, and the next quorum heals group 1 from group 2: the two end bitwise identical."""
    steps = 80
    args = [
        f"tokens.train_steps={steps}",
        f"checkpoints.checkpoint_interval={steps}",
        f"checkpoints.checkpoints_path={tmp_path / 'ck'}",
        "mesh3d.existing_checkpoints=resume",
    ]
    donor = _group(0, 1, tmp_path, lighthouse, *args, groups=3, env={"MESH3D_FT_DIE_SENDING": "1"})
    b = _group(1, 1, tmp_path, lighthouse, *args, groups=3)
    c = _group(2, 1, tmp_path, lighthouse, *args, groups=3)
    while len(losses(tmp_path / "m1.jsonl")) < 5:
        assert b.procs[0].poll() is None, b.output()[-2000:]
        time.sleep(0.05)
    b.procs[0].kill()
    b.procs[0].wait()
    again = _group(1, 1, tmp_path, lighthouse, *args, groups=3, tag="r")
    codes = [donor.wait(timeout=240), c.wait(timeout=240), again.wait(timeout=240)]
    assert codes == [[-signal.SIGKILL], [0], [0]], (again.output()[-2000:], c.output()[-2000:])
    healed = re.search(r"replica group 1 healed from a live peer: at step (\d+)", again.output())
    assert healed, again.output()[-3000:]
    assert "was not applied" in c.output()
    assert [m["iteration"] for m in _metrics(tmp_path / "m2.jsonl")] == list(range(1, steps + 1))
    final = [tmp_path / "ck" / f"replica_{g}" / str(steps) for g in (2, 1)]
    n = sum(_files_equal(*final, under) for under in ("model", "optimizer", "lr_scheduler"))
    print(f"donor died as group 1 healed; group 1 healed from group 2 at step "
          f"{healed.group(1)}; {n} checkpoint files bitwise identical")  # fmt: skip


@pytest.mark.parametrize("case", ["same replica id", "different configs"])
def test_groups_that_cannot_train_together_stop_with_one_line(lighthouse, tmp_path, case):
    first = _group(
        0,
        1,
        tmp_path,
        lighthouse,
        "tokens.train_steps=5",
        f"checkpoints.checkpoints_path={tmp_path / 'a'}",
        "checkpoints.checkpoint_interval=5",
    )
    second = ["mesh3d.fault_tolerance.replica_id=0"] if case == "same replica id" else \
        ["optimizer.learning_rate_scheduler.learning_rate=0.002"]  # fmt: skip
    other = _group(
        1,
        1,
        tmp_path,
        lighthouse,
        "tokens.train_steps=5",
        f"checkpoints.checkpoints_path={tmp_path / 'b'}",
        "checkpoints.checkpoint_interval=5",
        *second,
    )
    codes = [first.wait(timeout=120), other.wait(timeout=120)]
    assert codes == [[2], [2]], (first.output()[-2000:], other.output()[-2000:])
    lines = [x for x in first.output().splitlines() if x.startswith("error:")]
    expect = "two replica groups run as" if case == "same replica id" else "run different configs"
    assert len(lines) == 1 and expect in lines[0], first.output()[-2000:]
    assert not (tmp_path / "m0.jsonl").exists() or losses(tmp_path / "m0.jsonl") == []


def test_an_unreachable_lighthouse_is_one_line_before_training(tmp_path):
    port = free_port()
    job = _group(
        0,
        2,
        tmp_path,
        f"http://127.0.0.1:{port}",
        "tokens.train_steps=5",
        "parallelism.dp=2",
        f"checkpoints.checkpoints_path={tmp_path / 'ck'}",
        "checkpoints.checkpoint_interval=5",
    )
    assert job.wait(timeout=120) == [2, 2], job.output()[-2000:]
    lines = [x for x in job.output().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}: no lighthouse answers there" in lines[0], lines
    assert "Traceback" not in job.output() + job.output(1)


def test_a_lighthouse_restart_ends_every_group_with_one_line(tmp_path):
    """The lighthouse killed at step 5 and started again 2 s later on its port: torchft's
    quorum requests in flight fail, so every group ends within its quorum timeout with one
    line naming the lighthouse, exit 4 (never a hang; each group's checkpoints stay intact)."""
    import subprocess

    port = free_port()

    def start():
        return subprocess.Popen(
            ["torchft_lighthouse", "--min_replicas", "1", "--bind", f"[::]:{port}",
             "--join_timeout_ms", "200", "--heartbeat_timeout_ms", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"),
        )  # fmt: skip

    server = start()
    time.sleep(0.5)
    address = f"http://127.0.0.1:{port}"
    args = ["tokens.train_steps=200", "mesh3d.fault_tolerance.quorum_timeout_s=8",
            "mesh3d.fault_tolerance.timeout_s=8"]  # fmt: skip
    groups = [_group(g, 1, tmp_path, address, *args) for g in range(2)]
    try:
        while len(losses(tmp_path / "m0.jsonl")) < 5:
            assert groups[0].procs[0].poll() is None, groups[0].output()[-2000:]
            time.sleep(0.05)
        server.kill()
        server.wait()
        killed = time.monotonic()
        time.sleep(2)
        server = start()
        codes = [g.wait(timeout=120) for g in groups]
        took = time.monotonic() - killed
    finally:
        server.kill()
    assert codes == [[4], [4]], [g.output()[-2000:] for g in groups]
    assert took < 8 + 20, took
    for g in groups:
        lines = [x for x in g.output().splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and f"check that the lighthouse ({address}) is up" in lines[0], lines
    print(f"lighthouse restarted: both groups ended {took:.1f} s after its kill, exit 4")


# recipes/fault_tolerance/run_local.py: bad input is one line and exit 2 before anything starts


def _run_local():
    """recipes/fault_tolerance/run_local.py (not a package), imported by file."""
    import importlib.util

    path = REPO / "recipes" / "fault_tolerance" / "run_local.py"
    spec = importlib.util.spec_from_file_location("run_local", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags,says",
    [(["--groups", "0"], "--groups 0 must be >= 1"),
     (["--groups", "-1"], "--groups -1 must be >= 1"),
     (["--kill", "5", "--groups", "2"], "--kill 5 is not a replica group of --groups 2; give one of 0..1"),
     (["--kill", "-1"], "--kill -1 is not a replica group"),
     (["--kill", "1", "--kill-at", "0"], "--kill-at 0 must be >= 1"),
     (["--restart-after", "-1"], "--restart-after -1.0 must be >= 0"),
     (["--kill", "1", "--kill-at", "100", "--config-file", str(CFG), "tokens.train_steps=2"],
      "--kill-at 100 with tokens.train_steps=2: group 1 would have finished before the kill"),
     (["--config-file", "mytiny.yaml"], "--config-file mytiny.yaml: no such file"),
     (["--output", "FILE", "--config-file", str(CFG)], "is a file; give a folder")],
)  # fmt: skip
def test_run_local_refuses_bad_flags_before_starting_anything(tmp_path, capsys, monkeypatch,
                                                              flags, says):  # fmt: skip
    """They started a lighthouse (and groups, or killed one) and then ended in a traceback:
    max() of an empty sequence, KeyError: 5, a negative sleep, ProcessLookupError."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    with pytest.raises(SystemExit) as e:
        _run_local().main(flags)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and says in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "lighthouse at" not in out, (out, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing written


def test_run_local_keeps_the_users_keys_and_reads_paths_against_the_current_folder(
    tmp_path, monkeypatch
):
    """`mesh3d.existing_checkpoints=overwrite` was overridden by the appended resume; a relative
    --config-file was looked up in the repo (the groups ran there), a relative --output put the
    groups' files under the repo; cpu_tiny.yaml (no checkpoints section) stopped both groups."""
    run_local = _run_local()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytiny.yaml").write_text(CFG.read_text())

    def train_args(*argv):
        import argparse

        a = argparse.Namespace(output=(tmp_path / "out"), kill=None, kill_at=10)
        return run_local.train_args(a, list(argv))

    args = train_args("--config-file", "mytiny.yaml", "mesh3d.existing_checkpoints=overwrite")
    assert args[:2] == ["--config-file", str(tmp_path / "mytiny.yaml")]
    assert "mesh3d.existing_checkpoints=resume" not in args
    assert f"checkpoints.checkpoints_path={tmp_path / 'out' / 'checkpoints'}" in args
    assert "checkpoints.checkpoint_interval=10" in args  # the config has no checkpoints section
    args = train_args("--config=mytiny.yaml", "checkpoints.checkpoint_interval=3",
                      "checkpoints.checkpoints_path=ck")  # fmt: skip
    assert args[0] == f"--config={tmp_path / 'mytiny.yaml'}"
    assert "mesh3d.existing_checkpoints=resume" in args
    assert "checkpoints.checkpoint_interval=10" not in args
    assert [x for x in args if x.startswith("checkpoints.checkpoints_path=")] == [
        f"checkpoints.checkpoints_path={tmp_path / 'ck'}"
    ]
    assert train_args("mytiny.yaml")[0] == str(tmp_path / "mytiny.yaml")  # positional CONFIG


def test_run_local_kill_group_tolerates_a_group_that_already_exited():
    """kill_group raised ProcessLookupError for a group that had finished (--kill-at past its
    last step)."""
    import subprocess

    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    _run_local().kill_group(proc)  # no ProcessLookupError
    assert proc.returncode == 0


def _run_local_job(tmp_path: Path, *argv: str):
    import subprocess
    import sys

    command = [sys.executable, str(REPO / "recipes" / "fault_tolerance" / "run_local.py"), *argv]
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_run_local_names_a_failed_groups_error_and_appends_to_its_log(tmp_path):
    """The console said only `group 0: exit 2, no step`; a rerun erased the previous log."""
    (tmp_path / "mytiny.yaml").write_text(CFG.read_text())
    argv = ["--groups", "1", "--output", "out", "--config-file", "mytiny.yaml",
            "tokens.sequence_length=0", "tokens.train_steps=2"]  # fmt: skip
    for _ in range(2):
        job = _run_local_job(tmp_path, *argv)
        out, err = job.communicate(timeout=120)
        assert job.returncode == 2, (out, err)
        assert "group 0: exit 2, no step" in out, out
        said = [x for x in out.splitlines() if x.startswith("group 0: error:")]
        assert len(said) == 1 and "tokens.sequence_length" in said[0], out
        assert "Traceback" not in out + err, (out, err)
    log = (tmp_path / "out" / "group_0" / "log.txt").read_text()
    assert log.count("=== run_local.py: group 0 started") == 2, log


def test_run_local_forwards_ctrl_c_to_the_groups_which_save_and_exit_75(tmp_path):
    """Ctrl-C gave a KeyboardInterrupt traceback, exit 130, and left the groups (their own
    sessions) running unsaved."""
    job = _run_local_job(tmp_path, "--groups", "1", "--output", "out", "--config-file", str(CFG),
                         *SMALL, "tokens.train_steps=10000", "logging.log_level=warning")  # fmt: skip
    metrics = tmp_path / "out" / "group_0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and losses(metrics)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 75, (out, err)
    assert "Traceback" not in out + err and "SIGINT received: forwarded" in err, (out, err)
    assert "group 0: exit 75, steps 1-" in out, out
    saved = [p.name for p in (tmp_path / "out" / "checkpoints" / "replica_0").iterdir()]
    assert saved, "the group saved nothing"
