"""The ("pp", "dp", "cp", "tp") mesh: rank arithmetic, the live 8-rank mesh, and the rank harness itself.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_mesh.py`."""

import pytest
import torch
from test_mesh import DIAGRAM_GROUPS

import mesh3d.mesh
from mesh3d.errors import ConfigError, UserError
from mesh3d.mesh import AXES, ParallelDims, resolve_device


def test_groups_2x2x2_match_the_documented_diagram():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    for axis, groups in DIAGRAM_GROUPS.items():
        assert dims.groups(axis) == groups
        assert " ".join(str(g) for g in groups) in mesh3d.mesh.__doc__  # diagram kept in sync


def test_coords_follow_nanotron_order_tp_fastest():
    dims = ParallelDims(dp=3, tp=2, pp=4)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert rank == (c["pp"] * dims.dp + c["dp"]) * dims.tp + c["tp"]
        seen.add((c["pp"], c["dp"], c["tp"]))
    assert len(seen) == 24
    assert ParallelDims(dp=2, tp=2, pp=2).coords(6) == {"pp": 1, "dp": 1, "cp": 0, "tp": 0}
    with pytest.raises(ValueError, match="rank 24"):
        dims.coords(24)


@pytest.mark.parametrize(
    "dims",
    [
        ParallelDims(3, 2, 4),
        ParallelDims(1, 8, 1),
        ParallelDims(1, 1, 1),
        ParallelDims(2, 2, 1, cp=3),
    ],
)
def test_groups_partition_the_world_along_their_axis(dims):
    for axis in AXES:
        groups = dims.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        for g in groups:
            assert [dims.coords(r)[axis] for r in g] == list(range(getattr(dims, axis)))
            for other in set(AXES) - {axis}:
                assert len({dims.coords(r)[other] for r in g}) == 1


def test_validate_names_all_four_numbers_and_the_fix():
    ParallelDims(dp=2, tp=2, pp=2).validate(8)
    with pytest.raises(ConfigError) as e:
        ParallelDims(dp=4, tp=2, pp=2).validate(8)
    msg = str(e.value)
    assert all(s in msg for s in ("4 * 2 * 2 = 16", "world size is 8", "dp=2", "nproc_per_node=16"))
    with pytest.raises(
        ConfigError, match=r"`parallelism.tp` is 0 \(dp=2, tp=0, pp=1, world size 8\)"
    ):
        ParallelDims(dp=2, tp=0, pp=1).validate(8)
    assert isinstance(e.value, UserError)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match="'tpu' is not known"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="set `mesh3d.device` to 'auto' or 'cpu'"):
            resolve_device("cuda")
