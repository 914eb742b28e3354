"""Replica ranks stay quiet below WARNING unless asked for `debug` (mesh3d/log.py).

- `is_primary`: world rank 0 and the last pipeline rank's dp 0 / tp 0 rank (the metrics owner),
  for every layout of 8 ranks, checked against the rank grid.
- `effective_level`: a replica's `info` / `warning` mean WARNING, `debug` and `error` are kept;
  a primary rank keeps its level.
- End to end: dp 2 with `log_level_replica: info` prints the start lines once.

The tests of this subject that launch real processes are in
`tests/launch/test_log_levels_launch.py`."""

import logging

import pytest

from mesh3d.log import effective_level, is_primary, logger, setup_logging
from mesh3d.mesh import ParallelDims


@pytest.mark.parametrize(
    "dp,tp,pp,cp",
    [(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (2, 2, 2, 1), (1, 2, 4, 1), (4, 1, 2, 1),
     (1, 2, 2, 2), (2, 1, 2, 2), (1, 1, 1, 8)],
)  # fmt: skip
def test_primary_ranks_are_rank_0_and_the_last_pipeline_ranks_first(dp, tp, pp, cp):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp)
    owner = {"pp": pp - 1, "dp": 0, "cp": 0, "tp": 0}
    want = {0} | {r for r in range(8) if dims.coords(r) == owner}
    assert {r for r in range(8) if is_primary(dims.coords(r), r, 8)} == want


def test_replicas_log_warnings_unless_debug():
    assert effective_level("info", primary=True) == logging.INFO
    assert effective_level("info", primary=False) == logging.WARNING
    assert effective_level("warning", primary=False) == logging.WARNING
    assert effective_level("error", primary=False) == logging.ERROR
    assert effective_level("debug", primary=False) == logging.DEBUG


def test_setup_logging_reads_the_rank_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    setup_logging({"pp": 0, "dp": 1, "tp": 0}, "info")
    assert logger.level == logging.WARNING
    setup_logging({"pp": 0, "dp": 1, "tp": 0}, "debug")
    assert logger.level == logging.DEBUG
    monkeypatch.setenv("RANK", "0")
    setup_logging({"pp": 0, "dp": 0, "tp": 0}, "info")
    assert logger.level == logging.INFO
