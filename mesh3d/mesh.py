"""The device mesh: parallel degrees -> one named `DeviceMesh` with axes ("pp", "dp", "cp", "tp").

Global ranks fill the mesh shape (pp, dp, cp, tp) in C order, tp fastest, as in Nanotron, so a
tp group is a run of consecutive ranks and stays inside a node. dp=2, tp=2, pp=2 on 8 ranks:

                  pp stage 0                        pp stage 1
                tp 0     tp 1                     tp 0     tp 1
        dp 0  [ rank 0   rank 1 ]         dp 0  [ rank 4   rank 5 ]
        dp 1  [ rank 2   rank 3 ]         dp 1  [ rank 6   rank 7 ]

    tp groups (a row):                         [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups (a column):                      [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups (one place in every stage):      [0, 4] [1, 5] [2, 6] [3, 7]

The cp axis is always in the mesh (size 1 when off). Parameters are replicated over dp and cp
alike: their gradients are reduced over the flattened dp x cp group (`replica_mesh`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh3d.errors import ConfigError, UserError
from mesh3d.torch_private import flatten_mesh, pg_timeout_setter, unflatten_mesh

AXES = ("pp", "dp", "cp", "tp")  # mesh dimension names, outermost first; tp varies fastest


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees; `dp * cp * tp * pp` must equal the number of processes.

    Example:

        dims = mesh3d.ParallelDims(dp=2, tp=2, pp=2)
        dims.coords(5)   # {'pp': 1, 'dp': 0, 'cp': 0, 'tp': 1}
    """

    dp: int
    tp: int
    pp: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The mesh shape, in `AXES` order."""
        return (self.pp, self.dp, self.cp, self.tp)

    def validate(self, world_size: int) -> None:
        """Raise `ConfigError` unless every degree is >= 1 and dp * cp * tp * pp == world_size."""
        cp = f", cp={self.cp}" if self.cp != 1 else ""
        numbers = f"dp={self.dp}{cp}, tp={self.tp}, pp={self.pp}, world size {world_size}"
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                key = "context_parallel_size" if axis == "cp" else axis
                raise ConfigError(
                    f"`parallelism.{key}` is {value!r} ({numbers}); every degree must be an "
                    f"integer >= 1 and dp * cp * tp * pp must equal the world size"
                )
        if self.world_size != world_size:
            others = self.cp * self.tp * self.pp
            hint = f" (e.g. dp={world_size // others})" if world_size % others == 0 else ""
            key, value = ("cp * ", f"{self.cp} * ") if self.cp != 1 else ("", "")
            product = f"{self.dp} * {value}{self.tp} * {self.pp}"
            raise ConfigError(
                f"`parallelism` dp * {key}tp * pp = {product} = "
                f"{self.world_size}, but the world size is {world_size}; set the degrees so "
                f"that their product is {world_size}{hint}, or launch {self.world_size} "
                f"processes (torchrun --nproc_per_node={self.world_size})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": ..., "dp": ..., "cp": ..., "tp": ...}: where global `rank` sits in the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        return {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": rank // (self.cp * self.tp) % self.dp,
            "cp": rank // self.tp % self.cp,
            "tp": rank % self.tp,
        }

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every `axis` group (ranks equal in the other coordinates), in
        ascending order of their first rank; each lists its ranks in ascending order."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {AXES}")
        by_others: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            others = tuple(v for a, v in self.coords(rank).items() if a != axis)
            by_others.setdefault(others, []).append(rank)
        return list(by_others.values())


def resolve_device(device: str = "auto") -> torch.device:
    """The torch device for `device`: "auto" (cuda if available, else cpu), "cpu" or "cuda"."""
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"device {device!r} is not known; use 'auto', 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device 'cuda' was asked for, but torch {torch.__version__} sees no CUDA GPU; "
            f"set `mesh3d.device` to 'auto' or 'cpu' to run on the CPU"
        )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def init_distributed(timeout_s: float = 60, device: str = "auto") -> torch.device:
    """Start the default process group (unless started) and return this rank's device.

    Under torchrun (WORLD_SIZE set) the group comes from its environment and a CUDA rank uses
    GPU LOCAL_RANK; otherwise it is a one-process world. nccl on CUDA, gloo on CPU.

    Example:

        device = mesh3d.init_distributed()   # under torchrun, or a one-process world
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    backend = "nccl" if dev.type == "cuda" else "gloo"
    options = {"device_id": dev} if dev.type == "cuda" else {}
    if "WORLD_SIZE" in os.environ:  # bounded, and naming who never arrived
        from mesh3d.rendezvous import start_process_group

        start_process_group(backend, timeout_s, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s), **options)  # fmt: skip
    return dev


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "cp", "tp") mesh of shape (pp, dp, cp, tp) over the started process group.

    Example:

        init_distributed()
        mesh = build_mesh(ParallelDims(dp=2, tp=2, pp=2), "cpu")   # 8 processes
        mesh["tp"].get_group(), mesh["dp"].get_local_rank()
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs a process group; call init_distributed() first")
    dims.validate(dist.get_world_size())
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)


@functools.lru_cache(maxsize=8)
def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over which parameters are replicated: dp, or dp x cp flattened when
    context parallelism is on. Cached: building a sub-mesh costs ~2 ms."""
    if "cp" not in (mesh.mesh_dim_names or ()) or mesh["cp"].size() == 1:
        return mesh["dp"]
    return flatten_mesh(mesh["dp", "cp"], "dp_cp")


@functools.lru_cache(maxsize=8)
def hsdp_mesh(mesh: DeviceMesh, dp_shard: int) -> DeviceMesh:
    """The 2-D ("dp_replicate", "dp_shard") mesh of HSDP (`mesh3d.dp_shard`): the replica mesh
    cut into groups of dp_shard consecutive dp ranks (x cp); FSDP shards inside a group."""
    replicas = replica_mesh(mesh)
    shard = dp_shard * replicas.size() // mesh["dp"].size()
    sizes, names = (replicas.size() // shard, shard), ("dp_replicate", "dp_shard")
    return unflatten_mesh(replicas, 0, sizes, names)


@dataclass(frozen=True)
class Groups:
    """A mesh's process groups and sizes, resolved once (`groups_of`): every `mesh["dp"]`
    builds a sub-mesh (~2 ms on CPU)."""

    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    replicas: dist.ProcessGroup  # dp, or dp x cp flattened (`replica_mesh`)
    dp_size: int
    tp_size: int
    pp_size: int
    replica_size: int


@functools.lru_cache(maxsize=8)
def groups_of(mesh: DeviceMesh) -> Groups:
    """The process groups of a ("pp", "dp", "cp", "tp") mesh, once per mesh."""
    replicas = replica_mesh(mesh)
    dp, tp, pp = mesh["dp"], mesh["tp"], mesh["pp"]
    return Groups(dp.get_group(), tp.get_group(), pp.get_group(), replicas.get_group(),
                  dp.size(), tp.size(), pp.size(), replicas.size())  # fmt: skip


def set_collective_timeout(mesh: DeviceMesh | None, seconds: float) -> None:
    """Every process group of `mesh`, and the default group, times out after `seconds`
    (torch gives a mesh's sub-groups its 30-minute default, whatever the default group has)."""
    set_timeout = pg_timeout_setter()
    if set_timeout is None:  # older torch: the groups keep their timeouts
        return
    groups = [None] + (list(mesh.get_all_groups()) if mesh is not None else [])
    if mesh is not None and "cp" in (mesh.mesh_dim_names or ()) and mesh["cp"].size() > 1:
        groups.append(replica_mesh(mesh).get_group())  # the flattened dp x cp group
    for group in groups:
        set_timeout(timedelta(seconds=seconds), group)


@contextlib.contextmanager
def collective_timeout(mesh: DeviceMesh | None, seconds: float, restore_s: float):
    """Run a block with every group's timeout at `seconds`, then set it back to `restore_s`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    set_collective_timeout(mesh, seconds)
    try:
        yield
    finally:
        set_collective_timeout(mesh, restore_s)


def mesh_from_config(cfg, device: str | None = None) -> DeviceMesh:
    """The mesh of a loaded config's `parallelism`, starting the process group if needed
    (`device`: None = the config's `mesh3d.device`).

    Example:

        mesh = mesh_from_config(load_config("cfg.yaml"))
    """
    dev = init_distributed(device=device or cfg.mesh3d.device)
    p = cfg.parallelism
    return build_mesh(ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.context_parallel_size), dev.type)


def shutdown_distributed(wait: bool = True) -> None:
    """End this process's part in the process groups at the end of a command.

    With `wait` (after a success) ranks first wait for each other, so none tears down while a
    peer still receives. The cached groups are dropped first: one that outlives
    `destroy_process_group` dies at interpreter exit with live gloo threads (`terminate called
    without an active exception`). Not after a `PeerError`: teardown can hang."""
    import gc
    import sys

    if not dist.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if wait and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        groups_of.cache_clear()
        replica_mesh.cache_clear()
        dist.destroy_process_group()
        gc.collect()  # model and mesh cycles holding groups go now, not at interpreter exit


def share(value, src: int = 0):
    """`value` of global rank `src`, on every rank (`value` itself without a process group)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]
