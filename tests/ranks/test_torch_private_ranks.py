"""`mesh3d/torch_private.py`'s accessors that need a process group, on one gloo rank: a DTensor's
spec and shard, torch's ParallelStyle hooks, DeviceMesh flatten / unflatten, the default store
and the group timeout setter. The rest, and the check that no other module reaches a private
torch API, are in `tests/unit/test_torch_private.py`."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from dist import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from mesh3d import torch_private as tp
from mesh3d.tp_styles import block_input, local_of


def _accessors(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    w = torch.arange(6.0).reshape(3, 2)
    d = distribute_tensor(w, mesh["dp"], [Shard(0)])
    out = {
        "spec": tp.dtensor_spec(d) is d._spec,
        "local": tp.local_tensor(d) is d._local_tensor,
        "local_of": local_of(nn.Parameter(d)).tolist() == w.tolist(),
    }
    lin = nn.Linear(2, 3)
    tp.partition_fn(ColwiseParallel(), "linear")("", lin, mesh["dp"])
    out["colwise"] = isinstance(lin.weight, DTensor) and lin.weight.placements == (Shard(0),)
    emb = nn.Embedding(4, 2)
    tp.partition_fn(RowwiseParallel(), "embedding")("", emb, mesh["dp"])
    out["embedding"] = emb.weight.placements == (Shard(0),)
    block = nn.Linear(2, 2)
    tp.apply_style(block_input(Replicate()), block, mesh["dp"])
    out["hook"] = len(block._forward_pre_hooks) == 1
    flat = tp.flatten_mesh(mesh, "dp_cp")
    out["flat"] = (flat.mesh_dim_names, flat.size())
    split = tp.unflatten_mesh(flat, 0, (1, 1), ("a", "b"))
    out["split"] = split.mesh_dim_names
    store = tp.default_store()
    store.set("mesh3d/torch_private", "ok")
    out["store"] = store.get("mesh3d/torch_private").decode()
    tp.pg_timeout_setter()(timedelta(seconds=60), None)
    out["group"] = dist.get_world_size()
    return out


def test_the_accessors_that_need_a_process_group():
    out = run_ranks(1, _accessors, timeout=120)[0]
    assert out == {
        "spec": True, "local": True, "local_of": True, "colwise": True, "embedding": True,
        "hook": True, "flat": (("dp_cp",), 1), "split": ("a", "b"), "store": "ok", "group": 1,
    }  # fmt: skip
