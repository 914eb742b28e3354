"""Real training processes for the fault tests: `recipes/train.py` ranks the test can signal.

    ranks = Ranks(2, ["--config-file", CFG, "parallelism.dp=2"])   # 2 processes, env:// rendezvous
    ranks.wait_for("iteration: 3")                                   # in rank 0's output
    ranks.send(1, signal.SIGSTOP)
    codes = ranks.wait(timeout=60)

Each rank is its own `python recipes/train.py` (no torchrun: ~3 s to start instead of ~9), with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as torchrun would, its output in a file. Unlike
`dist.run_ranks`, nothing is killed when a rank fails: the tests look at how the job fails.
Every process still running at the end is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env(**extra: str) -> dict[str, str]:
    """The environment of a CPU rank: one thread, no W&B, unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("MESH3D_FAIL_AT", None)
    env.update(extra)
    return env


class Ranks:
    """`world` ranks of `recipes/train.py ARGS`, output in `<folder>/rank-<r>.log`."""

    def __init__(self, world: int, args: list[str], folder: Path, env: dict | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        self.procs, self.logs = [], []
        for rank in range(world):
            log = self.folder / f"rank-{rank}.log"
            rank_env = quiet_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=port, **(env or {}))  # fmt: skip
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(TRAIN), *args],
                        cwd=REPO,
                        env=rank_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )  # fmt: skip
                )
            self.logs.append(log)
        self.started = time.monotonic()

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def wait_for(self, pattern: str, rank: int = 0, timeout: float = 120) -> re.Match:
        """Block until `pattern` appears in the rank's output (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output(rank))
            if found:
                return found
            if self.procs[rank].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(
            f"{pattern!r} not in rank {rank}'s output:\n{self.output(rank)[-3000:]}"
        )

    def send(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (None: still running after `timeout`, then killed)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        codes = [p.poll() for p in self.procs]
        self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def losses(metrics: Path) -> list[float]:
    """The `lm_loss` of every line of a metrics file ([] before it exists)."""
    if not metrics.exists():
        return []
    return [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]


def preempt_and_resume(launch: Callable[[Path], subprocess.Popen], sig: int, folder: Path):
    """`launch(metrics file)` twice: the first is sent `sig` after 3 logged steps and must save
    the step it stopped after (the caller checks its output); the second, the same command,
    must resume and finish. Returns (first process, its output, steps it did, both runs' losses,
    the second run's output)."""
    first = launch(folder / "first.jsonl")
    while len(losses(folder / "first.jsonl")) < 3:
        assert first.poll() is None, first.stdout.read()[-3000:]
        time.sleep(0.05)
    first.send_signal(sig)
    out, _ = first.communicate(timeout=120)
    done = len(losses(folder / "first.jsonl"))
    second = launch(folder / "second.jsonl")
    out2, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out2[-3000:]
    return first, out, done, losses(folder / "first.jsonl") + losses(folder / "second.jsonl"), out2
