"""Nanotron's own example configs: every one parses and round-trips unchanged, and each either
validates or is refused with one "not supported" message (never an ignored setting)."""

import re

import pytest
import yaml
from nanotron_fixtures import FIXTURES, fixture_paths, needs_fixtures

from mesh3d.checks import validate
from mesh3d.config import (
    AdamWOptimizerArgs,
    NanosetDatasetsArgs,
    PretrainDatasetsArgs,
    Qwen2Config,
    global_batch_size,
    load_config,
    padded_vocab_size,
    save_config,
)
from mesh3d.errors import ConfigError, UserError

pytestmark = needs_fixtures


NAMES = {
    "classic-config_nanoset.yaml",
    "classic-config_tiny_llama.yaml",
    "head-config_custom_dl.yaml",
    "head-config_nanoset.yaml",
    "head-config_qwen.yaml",
    "head-config_qwen_with_moe.yaml",
    "head-config_resume_training.yaml",
    "head-config_tiny_llama.yaml",
    "head-config_tiny_llama_with_s3_upload.yaml",
    "head-debug_config_tiny_llama.yaml",
}


def test_every_known_fixture_present_and_no_unknown_one():
    assert {p.name for p in fixture_paths()} == NAMES


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.name)
def test_fixture_parses_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert again == cfg
    text = (tmp_path / "saved.yaml").read_text()
    assert "dtype: bfloat16" in text
    assert list(yaml.safe_load(text)) == sorted(yaml.safe_load(text))


S3_FIXTURE = "head-config_tiny_llama_with_s3_upload.yaml"  # its s5cmd_path is on Nanotron's cluster


@needs_fixtures
def test_a_named_s5cmd_that_is_not_here_falls_back_to_the_one_on_path(monkeypatch, tmp_path):
    from mesh3d.checks import config_warnings

    cfg = load_config(FIXTURES / S3_FIXTURE)
    p = cfg.parallelism
    named = "'/fsx/nouamane/miniconda/envs/2-1-cu121/bin/s5cmd' is not found"
    fake = tmp_path / "s5cmd"  # an s5cmd on PATH: the config passes as written, with a warning
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    validate(cfg, p.dp * p.tp * p.pp)
    assert any(named in w and f"using {fake}" in w for w in config_warnings(cfg))
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no s5cmd at all: refused
    with pytest.raises(ConfigError, match=re.escape(f"needs s5cmd, and {named}")):
        validate(cfg, p.dp * p.tp * p.pp)


DATA_FIXTURES = {  # their configs validate; their data is not on this machine: a clear error
    "classic-config_nanoset.yaml": "dataset_folder .* does not exist",
    "head-config_nanoset.yaml": "dataset_folder .* does not exist",
    "head-config_qwen_with_moe.yaml": "dataset_folder .* does not exist",
    "classic-config_tiny_llama.yaml": "is not a local file or folder; mesh3d runs offline",
    "head-config_custom_dl.yaml": "is not a local file or folder; mesh3d runs offline",
    "head-debug_config_tiny_llama.yaml": "is not a local file or folder; mesh3d runs offline",
}


@pytest.mark.parametrize("name", sorted(DATA_FIXTURES))
def test_fixture_data_sections_are_supported_and_checked_before_training(name):
    from mesh3d.data.build import StagedData

    cfg = load_config(FIXTURES / name)  # classic tiny_llama: 1f1b with 1 microbatch at pp 2
    p = cfg.parallelism
    validate(cfg, p.dp * p.tp * p.pp)
    with pytest.raises(UserError, match=DATA_FIXTURES[name]):
        StagedData(cfg)


def test_head_tiny_llama_with_overrides_validates_at_world_8():
    overrides = ["checkpoints.checkpoint_interval=100000", "profiler=null"]
    cfg = load_config(FIXTURES / "head-config_tiny_llama.yaml", overrides)
    validate(cfg, world_size=8)
    assert global_batch_size(cfg) == 12  # 3 x 1 x dp 4
    assert padded_vocab_size(cfg) == 128256
    assert cfg.model.model_config.num_key_value_heads == 2
    assert cfg.parallelism.tp_mode == "REDUCE_SCATTER"
    assert cfg.general.run == "tiny_llama_%date_%jobid"  # expanded by the trainer, not at load


def test_fixture_forms_legacy_adam_and_dataset_folder():
    cfg = load_config(FIXTURES / "head-debug_config_tiny_llama.yaml")  # flat Adam keys
    assert cfg.optimizer.optimizer_factory == AdamWOptimizerArgs(1e-8, 0.9, 0.95, True, "adamW")
    assert isinstance(cfg.data_stages[0].data.dataset, PretrainDatasetsArgs)
    stages = load_config(FIXTURES / "classic-config_nanoset.yaml").data_stages
    ds = [s.data.dataset for s in stages]
    assert all(isinstance(d, NanosetDatasetsArgs) for d in ds)
    assert (ds[0].dataset_folder, ds[0].dataset_weights) == (["datasets/c4-es/tokenized"], [1.0])
    assert ds[1].dataset_weights is None and len(ds[1].dataset_folder) == 2
    assert ds[2].dataset_weights == [0.8, 0.2]
    qwen = load_config(FIXTURES / "head-config_resume_training.yaml").model.model_config
    assert isinstance(qwen, Qwen2Config) and qwen.rope_theta == 100000.0
