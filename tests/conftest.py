"""Shared test setup: the mesh3d logger back to its import-time state after every test.

`mesh3d.log.setup_logging` (run by `train()` and by tests in this process) gives the logger its
own handler, a level and `propagate = False`; a later test reading logs through pytest's
`caplog` would then see nothing.
"""

import logging

import pytest


@pytest.fixture(autouse=True)
def _fresh_mesh3d_logger():
    yield
    log = logging.getLogger("mesh3d")
    log.handlers.clear()
    log.propagate = True
    log.setLevel(logging.NOTSET)
