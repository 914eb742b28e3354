"""The start of the process group, bounded and explained: who never arrived.

Before `init_process_group`, each rank reaches the store within the collective timeout, writes
`{host, pid}` under `mesh3d/arrived/<rank>` and waits for every rank's; else a `PeerError` names
the ranks that never arrived. A failure to connect after that names the arrived ranks on this
host that are now stopped or gone (torch alone gave a store traceback that named nobody).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import torch.distributed as dist

from mesh3d.errors import PeerError

_ARRIVED = "mesh3d/arrived/"


def start_process_group(backend: str, timeout_s: float, **options) -> None:
    """`init_process_group` from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), with the rendezvous of the module doc."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    store = _store(rank, world, timeout)
    arrived = _arrive(store, rank, world, timeout_s)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout, **options)  # fmt: skip
    except Exception as e:  # a rank stopped or died between arriving and connecting
        raise PeerError(_connect_failed(e, rank, world, timeout_s, arrived)) from e


def _store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host = rank == 0 and not agent
    try:  # the host does not wait for the others here: `_arrive` does, and names them
        return dist.TCPStore(addr, port, world, is_master=host, timeout=timeout,
                             wait_for_workers=False, multi_tenant=not agent)  # fmt: skip
    except Exception as e:
        owner = "the launcher's agent" if agent else "rank 0"
        raise PeerError(
            f"rendezvous: the store at {addr}:{port}, hosted by {owner}, did not "
            f"answer within mesh3d.collective_timeout_s ({timeout.total_seconds():g} s): it is "
            f"not started, stopped, dead or unreachable ({_first_line(e)})"
        ) from e


def _arrive(store: dist.Store, rank: int, world: int, timeout_s: float) -> dict[int, dict]:
    """Mark this rank as arrived, wait for every rank; their {host, pid} by rank."""
    store.set(f"{_ARRIVED}{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    keys = [f"{_ARRIVED}{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        present = {r for r in range(world) if store.check([keys[r]])}
        missing = [r for r in range(world) if r not in present]
        if missing:
            here = ", ".join(f"rank {r} ({_where(store, keys[r])})" for r in sorted(present))
            raise PeerError(
                f"rendezvous: rank(s) {', '.join(map(str, missing))} of {world} "
                f"did not arrive within mesh3d.collective_timeout_s ({timeout_s:g} s): stopped, "
                f"dead, still starting, or never launched. Arrived: {here}. Check that every "
                "rank was started with the same MASTER_ADDR/MASTER_PORT, or raise "
                "collective_timeout_s if starting takes longer"
            ) from None
    return {r: json.loads(store.get(keys[r])) for r in range(world)}


def _where(store: dist.Store, key: str) -> str:
    info = json.loads(store.get(key))
    return f"host {info['host']}, pid {info['pid']}"


def _connect_failed(error: Exception, rank: int, world: int, timeout_s: float, arrived) -> str:
    host, gone = socket.gethostname(), []
    for r, info in sorted(arrived.items()):
        state = process_state(info["pid"]) if info["host"] == host and r != rank else "R"
        if state in (None, "Z", "X"):
            gone.append(f"rank {r} (pid {info['pid']}) is gone")
        elif state in ("T", "t"):
            gone.append(f"rank {r} (pid {info['pid']}) is stopped")
    found = "; ".join(gone) if gone else "no rank on this host is stopped or gone"
    return (
        f"the process group of {world} ranks did not connect within "
        f"mesh3d.collective_timeout_s ({timeout_s:g} s), though every rank had arrived: {found} "
        f"({_first_line(error)})"
    )


def process_state(pid: int) -> str | None:
    """The Linux process state letter of `pid` (T: stopped), None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
