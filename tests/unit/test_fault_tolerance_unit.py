"""`mesh3d.fault_tolerance` without processes: its config checks, what a replica group
changes in the config it runs, which data it reads, and what the groups must share. The
groups training together are tests/launch/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
from parity import TINY

from mesh3d.checks import validation_errors
from mesh3d.config import apply_overrides, config_from_dict

ft = pytest.importorskip("mesh3d.train.fault_tolerance")
pytest.importorskip("torchft", reason="torchft is not installed (pip install 'mesh3d[ft]')")

ON = ["mesh3d.fault_tolerance.replica_groups=2", "mesh3d.fault_tolerance.lighthouse=http://h:29510"]


def _cfg(*overrides: str):
    return apply_overrides(config_from_dict(TINY), [*ON, *overrides])


@pytest.mark.parametrize(
    "overrides, expect",
    [
        ([], "`mesh3d.fault_tolerance.replica_id` is not set and $MESH3D_REPLICA_ID"),
        (["mesh3d.fault_tolerance.replica_id=2"], "`mesh3d.fault_tolerance.replica_id` (2) must be in [0, replica_groups - 1 = 1]"),
        (["mesh3d.fault_tolerance.replica_id=0", "mesh3d.fault_tolerance.lighthouse=null"], "`mesh3d.fault_tolerance.lighthouse` is not set and $TORCHFT_LIGHTHOUSE is empty"),
        (["mesh3d.fault_tolerance.replica_id=0", "mesh3d.fault_tolerance.min_replicas=3"], "`mesh3d.fault_tolerance.min_replicas` (3) must be in [1, replica_groups = 2]"),
        (["mesh3d.fault_tolerance.replica_id=0", "mesh3d.fault_tolerance.timeout_s=0"], "`mesh3d.fault_tolerance.timeout_s` must be a finite number of seconds > 0"),
        (["mesh3d.fault_tolerance.replica_groups=0"], "`mesh3d.fault_tolerance.replica_groups` must be in [1, 10000], got 0"),
        (["mesh3d.fault_tolerance.replica_id=0", "mesh3d.hf_streaming=true"], "with `mesh3d.hf_streaming` is not supported yet"),
    ],
)  # fmt: skip
def test_config_checks_name_the_key_and_the_fix(monkeypatch, overrides, expect):
    monkeypatch.delenv("MESH3D_REPLICA_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    errors = validation_errors(_cfg(*overrides), world_size=1)
    assert any(expect in e for e in errors), errors


def test_replica_id_and_lighthouse_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESH3D_REPLICA_ID", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://other:1")
    cfg = _cfg("mesh3d.fault_tolerance.lighthouse=null")
    assert not [e for e in validation_errors(cfg, world_size=1) if "fault_tolerance" in e]
    group = ft.group_config(
        apply_overrides(
            cfg, ["checkpoints.checkpoints_path=/x/ck/", "checkpoints.checkpoint_interval=5"]
        )
    )
    assert group.mesh3d.fault_tolerance.replica_id == 1
    assert group.checkpoints.checkpoints_path == "/x/ck/replica_1"


def test_a_group_reads_its_dp_slots_of_a_groups_x_dp_run():
    cfg = ft.group_config(_cfg("mesh3d.fault_tolerance.replica_id=1", "parallelism.dp=2"))
    assert ft.data_config(cfg).parallelism.dp == 4 and cfg.parallelism.dp == 2
    assert [ft.data_slot(cfg, r, 2) for r in range(2)] == [(2, 4), (3, 4)]


def test_the_fingerprint_ignores_a_groups_own_keys_and_sees_the_rest():
    base = ft._fingerprint(ft.group_config(_cfg("mesh3d.fault_tolerance.replica_id=0")))
    own = _cfg("mesh3d.fault_tolerance.replica_id=1", "general.run=other",
               "checkpoints.checkpoints_path=/elsewhere", "checkpoints.checkpoint_interval=5",
               "mesh3d.fault_tolerance.lighthouse=http://b:1")  # fmt: skip
    assert ft._fingerprint(ft.group_config(own)) == base
    for change in ("optimizer.learning_rate_scheduler.learning_rate=0.5", "general.seed=123",
                   "tokens.micro_batch_size=1", "mesh3d.fault_tolerance.min_replicas=2"):  # fmt: skip
        other = _cfg("mesh3d.fault_tolerance.replica_id=0", change)
        assert ft._fingerprint(ft.group_config(other)) != base, change
    assert 0 <= base < 2**31  # exact in the float64 sum over up to 2**22 groups


def test_the_fingerprint_sees_another_mesh3d_version(monkeypatch):
    cfg = ft.group_config(_cfg("mesh3d.fault_tolerance.replica_id=0"))
    here = ft._fingerprint(cfg)
    monkeypatch.setattr(ft, "_version", lambda: "0.0.0-other")
    assert ft._fingerprint(cfg) != here
