"""Shared test setup: the helpers on `sys.path`, and the mesh3d logger reset after every test.

The tests are in three tiers, one folder each (see tests/README.md): `unit/` (one process, no
process group), `ranks/` (a process group: forked gloo ranks or torch's fake group) and
`launch/` (real processes). The helpers every tier uses (`dist`, `launch`, `parity`, ...) live
in `helpers/`; it goes on `sys.path` here, and so does each tier folder, so that the parts of a
subject split over two tiers share their constants (`from test_moe import MOE`) whichever tier
runs alone.

`mesh3d.log.setup_logging` (run by `train()` and by tests in this process) gives the logger its
own handler, a level and `propagate = False`; a later test reading logs through pytest's
`caplog` would then see nothing.
"""

import logging
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _folder in ("launch", "ranks", "unit", "helpers"):  # helpers first on the path
    if str(_HERE / _folder) not in sys.path:
        sys.path.insert(0, str(_HERE / _folder))

pytest_plugins = ["s3_server"]  # the `endpoint` and `s3` fixtures: a local S3 server


@pytest.fixture(autouse=True)
def _fresh_mesh3d_logger():
    yield
    log = logging.getLogger("mesh3d")
    log.handlers.clear()
    log.propagate = True
    log.setLevel(logging.NOTSET)
