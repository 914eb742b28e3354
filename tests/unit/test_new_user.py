"""What a new user meets first (issue 26, items 4-14): the default run resumes by running it
again, its model runs at tp 2 and 4, the first tweaks of a config are accepted with one warning,
and the CLI's small helps. The tests that start processes are in
`tests/launch/test_new_user_launch.py`."""

from __future__ import annotations

import pytest

from mesh3d import launch
from mesh3d.checks import validate
from mesh3d.config import expand_run_name, load_config


@pytest.fixture
def no_corpus(monkeypatch):
    """The default run without preparing its data (its folder overrides are not needed here)."""
    import mesh3d.data.corpus as corpus

    monkeypatch.setattr(corpus, "default_run_overrides", lambda: [])


def test_default_run_has_one_folder_and_resumes(no_corpus):
    """Two launches of `mesh3d train` resolve to the same run folder, and the second resumes."""
    first = launch._resolved(launch._split([]))
    second = launch._resolved(launch._split([]))
    assert first == second
    cfg = load_config(*first)
    assert cfg.general.run == "default" == expand_run_name(cfg.general.run)
    assert cfg.checkpoints.checkpoints_path == "runs/default/checkpoints"
    assert cfg.mesh3d.existing_checkpoints == "resume"


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
def test_default_model_runs_tensor_parallel(no_corpus, tp, pp):
    """The default model's heads divide by 2 and 4 (README: `generate --tp 2 --pp 2`)."""
    path, overrides = launch._resolved(launch._split([]))
    cfg = load_config(path, [*overrides, f"parallelism.tp={tp}", f"parallelism.pp={pp}"])
    validate(cfg, world_size=tp * pp)
