"""Training on when a replica group dies: `mesh3d.fault_tolerance` through torchft.

Each replica group is its own job (its own torchrun, its own process group and mesh: dp x tp x
pp x cp inside the group) and they train one model together. Rank r of every group is linked
to rank r of the others by torchft's reconfigurable gloo group; a torchft lighthouse keeps the
membership. Every step:

1. `begin(step)`: a quorum of the live groups (a synchronous one: it completes before the
   forward). A group that is behind (it restarted, or missed a commit) receives the model, the
   optimizer and LR-schedule state and the run's position from a live peer here, and jumps to
   the peer's step: no checkpoint is read.
2. `reduce(...)` (inside `train_step`, after the group's own gradient reduction and before the
   norm and clipping): one small sum of [loss x tokens, tokens, replica one-hot, config hash]
   over the quorum, then the gradients summed over it with each group's weighted by its share
   of the step's tokens. So the step's loss and gradient are the mean over the tokens actually
   trained, and with every group alive they are those of one job at dp = groups x dp.
3. `commit()`: torchft's should_commit; a step whose cross-group sum failed (a peer died
   during it) is not applied and is trained again with the new quorum.

Data: group g reads the dp slots g*dp .. (g+1)*dp - 1 of a run at dp = groups x dp
(`data_config`), so groups read disjoint samples and a run without faults reads what one job
at that dp reads. The samples of a dead group's slots are dropped for the steps it misses (not
taken over by the survivors): deterministic, and recorded per step (`ft_replicas`,
`ft_samples`). Checkpoints: each group saves to `<checkpoints_path>/replica_<g>` (`group_config`),
a complete checkpoint any layout resumes, with fault tolerance on or off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
import socket
import time
import warnings
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mesh3d.checks.ft_checks import KEY, lighthouse, replica_id
from mesh3d.config.load import config_to_dict
from mesh3d.errors import PeerError, UserError, on_every_rank
from mesh3d.log import logger

os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info


def group_config(cfg):
    """`cfg` as replica group g runs it: checkpoints under `<checkpoints_path>/replica_<g>`
    (each group's own folder, lock and retention) and the replica id resolved."""
    ft = cfg.mesh3d.fault_tolerance
    g = replica_id(cfg)
    m = dataclasses.replace(cfg.mesh3d, fault_tolerance=dataclasses.replace(ft, replica_id=g))
    out = dataclasses.replace(cfg, mesh3d=m)
    ck = cfg.checkpoints
    if ck is not None:
        path = f"{str(ck.checkpoints_path).rstrip('/')}/replica_{g}"
        out = dataclasses.replace(out, checkpoints=dataclasses.replace(ck, checkpoints_path=path))
    return out


def data_config(cfg):
    """The config the data is read with: dp = groups x dp, so a group's dp ranks are slots
    g*dp .. of every step's global batch (`Run.build` gives them those slots)."""
    ft, p = cfg.mesh3d.fault_tolerance, cfg.parallelism
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(p, dp=p.dp * ft.replica_groups))


def data_slot(cfg, dp_rank: int, dp: int) -> tuple[int, int]:
    """(dp slot, dp slots) this group's dp rank reads."""
    ft = cfg.mesh3d.fault_tolerance
    return ft.replica_id * dp + dp_rank, ft.replica_groups * dp


# what may differ between the groups' configs: folders, names, logging, the group's own keys
_OWN = (
    "general.run",
    "general.project",
    "checkpoints.",
    "logging.",
    "profiler.",
    "s3_upload.",
    "lighteval.",
    "mesh3d.fault_tolerance.replica_id",
    "mesh3d.fault_tolerance.lighthouse",
    "mesh3d.existing_checkpoints",
    "mesh3d.wandb",
    "mesh3d.tensorboard_dir",
    "mesh3d.console",
    "mesh3d.keep_",
    "mesh3d.hf_export",
    "mesh3d.upload_wait",
)


def _fingerprint(cfg) -> int:
    """A 31-bit hash of what every group must share (the config less `_OWN`) and mesh3d's
    version."""
    items = sorted(kv for kv in _flat(config_to_dict(cfg)) if not _own(kv[0]))
    text = repr(items) + _version()
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1


def _version() -> str:
    """mesh3d's installed version (the package's metadata; "unknown" from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mesh3d")
    except PackageNotFoundError:
        return "unknown"


def _own(key: str) -> bool:
    return key.startswith(_OWN) or any(key == p.rstrip(".") for p in _OWN)


def _flat(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flat(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}")
    else:
        yield prefix, repr(d)


def _check_lighthouse(address: str, timeout_s: float) -> None:
    """One line when nothing listens at the lighthouse address (torchft would retry and log)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    host, port = url.hostname or "localhost", url.port or 29510
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            pass
    except OSError as e:
        raise UserError(
            f"`{KEY}.lighthouse` {address}: no lighthouse answers there ({e.strerror or e}); "
            "start it first (`torchft_lighthouse --min_replicas 1`, or "
            "recipes/fault_tolerance/run_local.py) or fix the address"
        ) from None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Replicas:
    """This rank's link to its peers in the other replica groups (see the module doc)."""

    def __init__(self, run):
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        if logger.getEffectiveLevel() > logging.DEBUG:  # its per-step lines: at debug only
            for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
                logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

        cfg = run.cfg
        ft = cfg.mesh3d.fault_tolerance
        self.run, self.group, self.groups = run, ft.replica_id, ft.replica_groups
        self.fingerprint = _fingerprint(cfg)
        self.live, self.healed, self.progress = self.groups, None, (0, 0)
        self.first, self.quorum_timeout_s = True, ft.quorum_timeout_s
        self.lighthouse = lighthouse(cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        error = None
        if rank == 0:
            try:
                _check_lighthouse(lighthouse(cfg), ft.timeout_s)
            except UserError as e:
                error = str(e)
        shared = [error]
        if world > 1:
            dist.broadcast_object_list(shared, src=0)
        if shared[0]:
            raise on_every_rank(UserError(shared[0]))
        self._store = None
        store = {}
        if "MASTER_PORT" not in os.environ:  # a one-process world without torchrun: own store
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        timeout = timedelta(seconds=ft.timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
            rank=rank, world_size=world, lighthouse_addr=lighthouse(cfg),
            replica_id=f"mesh3d_replica_{self.group}", init_sync=False, **store,
        )  # fmt: skip
        self.manager.register_state_dict_fn("mesh3d", self._load, self._state)

    def start_at(self, step: int, consumed: int, tokens: int) -> None:
        """The run starts after step `step` (0, or a resumed checkpoint's)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.progress = (consumed, tokens)

    def begin(self, step: int) -> tuple[int, tuple[int, int] | None]:
        """The quorum before step `step`: (the step to train, (consumed samples, tokens) when
        this group healed from a peer and jumped there, else None)."""
        self.healed = None
        self._quorum(step)
        if self.first:  # a clean start waits for every group, so all train from step 1
            self.first, deadline = False, time.monotonic() + self.quorum_timeout_s
            while self.manager.num_participants() < self.groups and time.monotonic() < deadline:
                time.sleep(0.2)
                self._quorum(step)
        live, self.live = self.live, self.manager.num_participants()
        if live != self.live:
            logger.info(f"[FT] step {step}: {self.live} of {self.groups} replica groups train")
        done = self.manager.current_step()
        if self.healed is not None:
            logger.info(
                f"[FT] replica group {self.group} healed from a live peer: at step {done} "
                f"({self.live} group(s) in the quorum)"
            )
            return done + 1, self.healed
        return step, None

    def _quorum(self, step: int) -> None:
        """torchft's quorum; one line (exit 4) when there is none (the lighthouse gone, or not
        `min_replicas` groups within `quorum_timeout_s`)."""
        try:
            self.manager.start_quorum()
        except Exception as e:  # noqa: BLE001 - torchft raises RuntimeError or TimeoutError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerError(
                f"replica group {self.group}: no torchft quorum before step {step} ({first[:200]}); "
                f"check that the lighthouse ({self.lighthouse}) is up and that at least "
                f"`{KEY}.min_replicas` groups run, then start this group again (it heals from a "
                "live peer, or resumes from its checkpoints with existing_checkpoints: resume)"
            ) from None

    def reduce(self, params, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        """The quorum's mean loss; `params`' gradients become the quorum's token-weighted mean.
        `loss`: this group's mean token loss, `tokens`: its denominator."""
        m = self.manager
        head = torch.zeros(3 + self.groups, dtype=torch.float64)
        head[0], head[1] = float(loss) * tokens, tokens
        head[2] = self.fingerprint
        head[3 + self.group] = 1
        m.allreduce(head, reduce_op=dist.ReduceOp.SUM).wait()
        n = m.num_participants()
        if not m.errored():
            self._check(head, n)
        total = float(head[1]) or 1.0
        share = tokens / total
        grads = [_local(p.grad) for p in params if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same]).mul_(share)
            m.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            at = 0
            for g in same:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        return torch.tensor(float(head[0]) / total, dtype=loss.dtype)

    def _check(self, head: torch.Tensor, n: int) -> None:
        """Two groups with one replica id, or groups with different configs or versions: one
        line on every rank, before the step is applied."""
        twice = [g for g in range(self.groups) if head[3 + g] > 1.5]
        if twice:
            raise on_every_rank(UserError(
                f"two replica groups run as `{KEY}.replica_id` {twice[0]}: give each job its "
                f"own index in 0 .. {self.groups - 1}"))  # fmt: skip
        if float(head[2]) != float(self.fingerprint) * n:
            raise on_every_rank(UserError(
                "the replica groups run different configs or mesh3d versions (only "
                f"`{KEY}.replica_id` and the checkpoint folder may differ): start every group "
                "with the same config file and the same mesh3d"))  # fmt: skip

    def commit(self) -> bool:
        """Whether the step may be applied (every group's sum succeeded); kept as `committed`
        for `Run.step`."""
        self.committed = self.manager.should_commit()
        return self.committed

    def metrics(self, samples_per_group: int) -> dict:
        return {"ft_replicas": self.live, "ft_samples": self.live * samples_per_group}

    # -- healing: what a live peer sends, and how it is taken --------------------------------

    def _state(self) -> dict:
        if os.environ.get("MESH3D_FT_DIE_SENDING") == "1":  # the fault tests: a donor that dies
            os.kill(os.getpid(), signal.SIGKILL)  # as a healing group asks for its state
        run = self.run
        return {
            "progress": self.progress,
            "model": [
                {k: _local(v).detach().clone() for k, v in mod.state_dict().items()}
                for mod in run.parts.modules
            ],
            "optimizer": _optimizer_state(run.optimizer),
            "scheduler": run.scheduler.state_dict(),
        }

    def _load(self, state: dict) -> None:
        run = self.run
        with torch.no_grad():
            for mod, saved in zip(run.parts.modules, state["model"], strict=True):
                own = mod.state_dict()
                for k, v in saved.items():
                    _local(own[k]).copy_(v)
        _load_optimizer_state(run.optimizer, state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        self.healed = tuple(state["progress"])

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _optimizer_state(optimizer) -> dict:
    """The optimizer's state with each tensor as this rank's local part, keyed by the
    parameter's position in the param groups (the same in every group: one layout), and each
    param group's settings under "groups" (its current lr among them: the LR schedule's
    state alone sets it only at its next step)."""
    out, k = {"groups": [{n: v for n, v in g.items() if n != "params"}
                         for g in optimizer.param_groups]}, 0  # fmt: skip
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[k] = {
                name: (_local(v).detach().clone() if torch.is_tensor(v) else v)
                for name, v in optimizer.state.get(p, {}).items()
            }
            k += 1
    return out


def _load_optimizer_state(optimizer, saved: dict) -> None:
    """Take a peer's optimizer state: a tensor held as a DTensor like its parameter's gets the
    parameter's mesh and placements back; a group that never stepped gets the state created."""
    for group, settings in zip(optimizer.param_groups, saved["groups"], strict=True):
        group.update(settings)
    k = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = {}
            for name, v in saved[k].items():
                if torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == _local(p).shape:
                    v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride())  # fmt: skip
                elif torch.is_tensor(v) and v.dim() > 0:
                    v = v.to(p.device)
                state[name] = v
            optimizer.state[p] = state
            k += 1
