"""Running local ranks through torch's elastic agent, as torchrun does (`mesh3d train` at a
world size above 1, and recipes/slurm/launch.py): loaded only when this process starts ranks."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from pathlib import Path


def run_agent(args: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str = "localhost:0",
              run_id: str | None = None) -> None:  # fmt: skip
    """Run `python ARGS` as `nproc` ranks on this node (of `nnodes`, by c10d rendezvous at
    `rdzv_endpoint`) through torch's elastic agent, as torchrun does, but a failing rank's own
    `error:` line is the only message and the exit code is the ranks'."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the ranks say what went wrong
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    agent_signals = _forward_stop_signals()
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = agent_signals  # torch < 2.9 reads only this
    new = "signals_to_handle" in LaunchConfig.__dataclass_fields__
    options = {"signals_to_handle": agent_signals} if new else {}
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=run_id or str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint,
        max_restarts=0, monitor_interval=0.1, start_method="spawn", **options,
    )  # fmt: skip
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as e:  # the ranks' own codes: 75 only when they saved
        codes = sorted({f.exitcode for f in e.failures.values()})
        code = next((c for c in codes if c > 0), 1)
        raise SystemExit(code) from None
    except SignalException as e:  # SIGHUP/SIGQUIT, or any stop signal where /proc is missing:
        raise SystemExit(128 + int(e.sigval)) from None  # the agent stopped the ranks
    except RendezvousTimeoutError:  # (this module sits below mesh3d.errors: its line by hand)
        print(f"error: the {nnodes} nodes did not all join the rendezvous at {rdzv_endpoint} in "
              "time: start the same command on every node, with a rendezvous host and port they "
              "can all reach", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(2) from None


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


def _forward_stop_signals() -> str:
    """Forward Ctrl-C, SIGTERM and SIGUSR1 to the ranks, each time one arrives; returns the
    signals left to torch's agent. The ranks decide what a stop signal means and say it with
    their exit codes (torch's agent would stop them and exit with a code of its own). Needs
    /proc to find the ranks."""
    if not Path("/proc/self/stat").is_file():
        return ",".join((*STOP_SIGNALS, "SIGHUP", "SIGQUIT"))

    def forward(signum, frame) -> None:
        pids = _child_pids()
        if not pids:  # no rank yet (waiting for the other nodes): nothing to save, stop now
            name = signal.Signals(signum).name
            print(f"error: {name} while waiting for the other nodes to join: stopped before any "
                  "rank started, nothing was trained", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(128 + signum)
        for pid in pids:
            try:
                os.killpg(pid, signum)  # the agent starts each rank in its own session
            except OSError:
                with contextlib.suppress(OSError):
                    os.kill(pid, signum)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    return "SIGHUP,SIGQUIT"


def _child_pids() -> list[int]:
    """The processes this one started (Linux /proc): the ranks."""
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == me:
            out.append(int(entry.name))
    return out
