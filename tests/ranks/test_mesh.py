"""The ("pp", "dp", "cp", "tp") mesh: rank arithmetic, the live 8-rank mesh, and the rank harness itself.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_mesh_unit.py`."""

import os
import re
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

from mesh3d.mesh import AXES, ParallelDims, build_mesh, init_distributed

# The groups drawn in mesh3d/mesh.py's docstring for dp=2, tp=2, pp=2.
DIAGRAM_GROUPS = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


# ---- the live mesh -----------------------------------------------------------------------------


LIVE = (ParallelDims(dp=2, tp=2, pp=2), ParallelDims(dp=1, tp=2, pp=2, cp=2))


def _mesh_facts(rank: int, world_size: int) -> list[dict]:
    out = []
    for dims in LIVE:
        mesh = build_mesh(dims, "cpu")
        facts = {"coords": list(mesh.get_coordinate()), "sums": {}, "groups": {}}
        for axis in AXES:
            sub = mesh[axis]
            facts["groups"][axis] = sub.mesh.tolist()
            x = torch.tensor([rank])
            dist.all_reduce(x, group=sub.get_group())
            facts["sums"][axis] = x.item()
        out.append(facts)
    return out


@pytest.fixture(scope="module")
def meshes() -> list[list[dict]]:
    return run_ranks(8, _mesh_facts, timeout=60)  # one launch shared by the tests below


@pytest.fixture(scope="module")
def mesh_2x2x2(meshes) -> list[dict]:
    return [facts[0] for facts in meshes]


def test_mesh_submeshes_are_the_computed_groups(meshes):
    """2x2x2, and cp2 x tp2 x pp2: every sub-mesh is the group `ParallelDims` computes."""
    for i, dims in enumerate(LIVE):
        for rank, of_rank in enumerate(meshes):
            facts, c = of_rank[i], dims.coords(rank)
            assert facts["coords"] == [c["pp"], c["dp"], c["cp"], c["tp"]]
            for axis in AXES:
                (group,) = [g for g in dims.groups(axis) if rank in g]
                assert facts["groups"][axis] == group
                assert facts["sums"][axis] == sum(group)
    assert [f[1]["groups"]["cp"] for f in meshes[:2]] == [[0, 2], [1, 3]]


def test_mesh_2x2x2_all_reduce_sums_each_group(mesh_2x2x2):
    for rank, facts in enumerate(mesh_2x2x2):
        for axis, groups in DIAGRAM_GROUPS.items():
            (group,) = [g for g in groups if rank in g]
            assert facts["sums"][axis] == sum(group), (rank, axis)


def _mesh_1x1x1(rank: int, world_size: int) -> dict:
    # init_distributed on an already started group only returns the device.
    device = init_distributed(device="cpu")
    mesh = build_mesh(ParallelDims(1, 1, 1), device.type)
    return {a: mesh[a].mesh.tolist() for a in AXES} | {"device": str(device)}


def test_mesh_1x1x1_on_one_rank():
    assert run_ranks(1, _mesh_1x1x1, timeout=30) == [
        {"pp": [0], "dp": [0], "cp": [0], "tp": [0], "device": "cpu"}
    ]


def _plain_python_world(rank: int, world_size: int) -> dict:
    # `python train.py` without torchrun: init_distributed makes a one-process world itself.
    dist.destroy_process_group()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var)
    device = init_distributed(timeout_s=10, device="cpu")
    mesh = build_mesh(ParallelDims(1, 1, 1), device.type)
    x = torch.ones(2)
    dist.all_reduce(x, group=mesh["dp"].get_group())
    return {"world": dist.get_world_size(), "sum": x.tolist(), "shape": tuple(mesh.shape)}


def test_init_distributed_without_torchrun_is_a_world_of_one():
    (facts,) = run_ranks(1, _plain_python_world, timeout=30)
    assert facts == {"world": 1, "sum": [1.0, 1.0], "shape": (1, 1, 1, 1)}


def _bad_layout(rank: int, world_size: int) -> None:
    build_mesh(ParallelDims(dp=2, tp=2, pp=1), "cpu")  # 4 ranks' worth on a world of 2


def test_build_mesh_refuses_a_layout_that_does_not_fit_before_any_collective():
    with pytest.raises(
        AssertionError, match=r"ConfigError: .*2 \* 2 \* 1 = 4, but the world size is 2"
    ):
        run_ranks(2, _bad_layout, timeout=30)


# ---- the harness (tests/helpers/dist.py) -------------------------------------------------------


def _rank_and_env(rank: int, world_size: int, scale: int, *, offset: int) -> tuple:
    env = {v: os.environ[v] for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return rank * scale + offset, env, dist.get_rank(), torch.get_num_threads()


def test_results_come_back_in_rank_order_with_args_and_env():
    results = run_ranks(4, _rank_and_env, 10, offset=1, timeout=30)
    assert [r[0] for r in results] == [1, 11, 21, 31]
    for rank, (_, env, dist_rank, threads) in enumerate(results):
        assert env == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank)}
        assert dist_rank == rank and threads == 1


def _raise_on_rank_3(rank: int, world_size: int) -> None:
    if rank == 3:
        raise ValueError("boom")
    dist.barrier()  # the others block here, waiting for rank 3 forever
    dist.all_reduce(torch.ones(1))


def test_a_raising_rank_fails_fast_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_ranks(4, _raise_on_rank_3, timeout=60)
    assert time.monotonic() - t0 < 5, "the launch waited for the blocked ranks"
    msg = str(e.value)
    assert "rank 3 of 4 failed" in msg and 'raise ValueError("boom")' in msg
    assert "ValueError: boom" in msg


def _hang_on_rank_2(rank: int, world_size: int) -> None:
    if rank == 2:
        while True:
            time.sleep(0.01)
    dist.barrier()


def test_a_hanging_rank_times_out_with_its_stack():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_ranks(3, _hang_on_rank_2, timeout=2)
    assert time.monotonic() - t0 < 8
    msg = str(e.value)
    assert "ranks [0, 1, 2] of 3 timed out" in msg
    rank_2_stack = msg.split("--- rank 2 ---")[1]
    assert re.search(r"line \d+ in _hang_on_rank_2", rank_2_stack)
    assert "in barrier" in msg.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]


def _die_in_native_code(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.barrier()


def test_a_rank_that_dies_without_a_traceback_is_reported():
    with pytest.raises(AssertionError, match="rank 1 of 2 failed:\nthe process exited with code 7"):
        run_ranks(2, _die_in_native_code, timeout=30)


def _unpicklable(rank: int, world_size: int):
    return lambda: rank


def test_an_unpicklable_result_is_reported():
    with pytest.raises(AssertionError, match="return value of rank 0 cannot be pickled"):
        run_ranks(1, _unpicklable, timeout=30)


def _matmuls(rank: int, world_size: int) -> float:
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))
    total = torch.tensor([(a @ a).abs().sum().item()])
    dist.all_reduce(total)
    return total.item()


def test_ranks_do_not_hang_after_the_parent_ran_threaded_matmuls():
    # a forked rank using the intra-op pool the parent already used hangs forever
    # (docs/torch-notes.md#a-forked-rank-must-use-one-intra-op-thread)
    a = torch.randn(1024, 1024)
    (a @ a).sum()
    results = run_ranks(8, _matmuls, timeout=60)
    assert len(set(results)) == 1


def _start_a_sleeper(rank: int, world_size: int) -> int:
    return subprocess.Popen(["sleep", "60"]).pid


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie waiting to be reaped is gone too
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_processes_started_by_a_rank_are_killed_with_it():
    (pid,) = run_ranks(1, _start_a_sleeper, timeout=30)
    deadline = time.monotonic() + 5
    while not _is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _is_gone(pid)
