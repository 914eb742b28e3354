"""The unit tier stays one process: a test here that starts a process, forks, or starts a process
group fails, naming the tier it belongs in (`tests/ranks`, `tests/launch`).

Checked while each test of this folder sets up, runs and tears down (its fixtures included).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess

import pytest
import torch.distributed
import torch.distributed.distributed_c10d


def _refuse(nodeid: str, what: str, tier: str):
    def refused(*args, **kwargs):
        raise AssertionError(
            f"{nodeid} {what}; tests/unit runs in one process without a process group: "
            f"move the test to {tier}"
        )

    return refused


@contextlib.contextmanager
def _one_process(item: pytest.Item):
    launch, ranks = "tests/launch", "tests/ranks"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refuse(item.nodeid, "starts a process", launch))
        mp.setattr(os, "fork", _refuse(item.nodeid, "forks", ranks))
        start = _refuse(item.nodeid, "starts a process", ranks)
        mp.setattr(multiprocessing.process.BaseProcess, "start", start)
        group = _refuse(item.nodeid, "starts a process group", ranks)
        mp.setattr(torch.distributed, "init_process_group", group)
        mp.setattr(torch.distributed.distributed_c10d, "init_process_group", group)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _one_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _one_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _one_process(item):
        return (yield)
