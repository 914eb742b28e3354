"""A process killed in the middle of writing a checkpoint leaves the previous one loadable, and
damaged training-state files give their own clear errors.

The tests of this subject that need a process group are in
`tests/ranks/test_checkpoint_crash_ranks.py`."""

from __future__ import annotations

import json

import pytest
import torch

from mesh3d.checkpoint import load, nanotron_state
from mesh3d.errors import UserError


def test_optimizer_file_errors(tmp_path):
    folder = tmp_path / "optimizer"
    folder.mkdir()
    with pytest.raises(UserError, match="load_optimizer: false"):
        load.OptimizerFiles(folder)
    (folder / "optimizer_config.json").write_text(
        json.dumps(nanotron_state.optimizer_config("x", 1, 1, 1, [], False))
    )
    with pytest.raises(UserError, match="no optimizer_\\*.pt files"):
        load.OptimizerFiles(folder)
    bad = folder / nanotron_state.optimizer_file(0, 1, 0, 1)
    bad.write_bytes(b"PK\x03\x04 not a whole zip file")
    with pytest.raises(UserError, match=f"cannot read optimizer file {bad}"):
        load.OptimizerFiles(folder)
    torch.save({"state": {}, "names": {0: "x"}, "evil": _NotPlain()}, bad)
    with pytest.raises(UserError, match="more than plain tensors"):
        load.OptimizerFiles(folder)


class _NotPlain:
    """A pickled object that `weights_only` loading must refuse."""


def test_metadata_errors(tmp_path):
    with pytest.raises(UserError, match="missing .*checkpoint_metadata.json"):
        load.read_metadata(tmp_path)
    meta = nanotron_state.metadata(1, 1, 4, 32, [], {})
    (tmp_path / "checkpoint_metadata.json").write_text(json.dumps({**meta, "version": "1.6"}))
    with pytest.raises(UserError, match="version 1.6, newer than the 1.5"):
        load.read_metadata(tmp_path)
    (tmp_path / "checkpoint_metadata.json").write_text(json.dumps({"version": "1.4"}))
    with pytest.raises(UserError, match="not a checkpoint_metadata.json"):
        load.read_metadata(tmp_path)


def test_zero1_ranges_follow_nanotron():
    # ceil(n/dp) each, the last dp*ceil(n/dp)-n ranks one less
    # (docs/nanotron-layout.md#optimizer-files)
    assert nanotron_state.zero1_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert nanotron_state.zero1_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert nanotron_state.zero1_ranges(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
