"""Nanotron's own classic tiny_llama config trains in mesh3d, and Nanotron can resume what mesh3d
saves: every file of a step folder checked against what Nanotron's loader asserts and does
(facts from its source; Nanotron itself needs CUDA, so its loading is re-enacted with torch).

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/ranks/test_nanotron_roundtrip.py`."""

import json

import pytest
import torch
from nanotron_fixtures import FIXTURES, needs_fixtures
from nanotron_keys import config_key_problems
from test_nanotron_roundtrip import DATA, ONE, PEAK, _base

from mesh3d.checkpoint import nanotron_state
from mesh3d.checkpoint.load import _load_scheduler, read_metadata
from mesh3d.config import (
    Qwen2Config,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
)
from mesh3d.config.load import nanotron_config_dict
from mesh3d.layout import RunLayout
from mesh3d.train.lr_schedule import lr_at, schedule_kwargs
from mesh3d.train.optim import build_optimizer

pytestmark = needs_fixtures


def test_nanotron_config_of_every_fixture_has_only_nanotron_keys():
    set_in_file = {"head-config_resume_training.yaml": ["model.model_config.interleaved_rotary"]}
    for path in sorted(FIXTURES.glob("*.yaml")):
        cfg = load_config(path)
        # mesh3d's own dump (save_config) has keys only mesh3d accepts only where they are set
        expected = [f"unknown key {k}" for k in set_in_file.get(path.name, [])]
        assert config_key_problems(config_to_dict(cfg)) == expected, path.name
        d = nanotron_config_dict(cfg, step=5, consumed=20)  # a step folder's: never
        assert config_key_problems(d) == [], path.name
        assert (d["general"]["step"], d["general"]["consumed_train_samples"]) == (5, 20)
        seq = cfg.tokens.sequence_length
        assert all(s["sequence_length"] == seq for s in d["data_stages"] or [])
    mesh3d_only = ["parallelism.moe_layer_recompute=true", "mesh3d.compile=true"]
    full = config_to_dict(apply_overrides(cfg, mesh3d_only))
    assert config_key_problems(full) == [
        "unknown key .mesh3d", "unknown key parallelism.moe_layer_recompute"
    ]  # fmt: skip
    assert config_key_problems(nanotron_config_dict(apply_overrides(cfg, mesh3d_only))) == []
    qwen = load_config(FIXTURES / "head-config_resume_training.yaml").model.model_config
    assert qwen.interleaved_rotary is not None  # the example has it; Nanotron's class has not
    assert Qwen2Config()._fused_rotary_emb and Qwen2Config()._fused_rms_norm  # Nanotron's
    assert Qwen2Config()._use_qkv_packed and Qwen2Config().log_attn_probs  # defaults: True


def test_mesh3d_reads_old_and_new_metadata_and_scheduler_files(tmp_path):
    new = nanotron_state.metadata(2, 2, 3, 12, [dict(name="s", start_training_step=1, consumed_train_samples=12,
                                        sequence_length=32, consumed_tokens_per_dataset_folder={})],
                     {"writer": "mesh3d", "pp": 2})  # fmt: skip
    old = json.loads(json.dumps(new))
    del old["cp"], old["metas"]["consumed_tokens_total"]
    for s in old["metas"]["data_stages"]:
        del s["sequence_length"], s["consumed_tokens_per_dataset_folder"]
    cfg = apply_overrides(config_from_dict(_base()), DATA + ONE)
    folder = tmp_path / "lr_scheduler"
    folder.mkdir()
    one_group = {"base_lrs": [PEAK], "last_epoch": 3, "_step_count": 4, "_last_lr": [1e-4],
                 "lr_lambdas": [None], "_is_initial": False, "_get_lr_called_within_step": False}  # fmt: skip
    for meta, sched in (
        (new, nanotron_state.lr_scheduler_state([PEAK] * 11, [1e-4] * 11, 3)),
        (old, one_group),
    ):
        (tmp_path / "checkpoint_metadata.json").write_text(json.dumps(meta))
        assert read_metadata(tmp_path)["metas"]["last_train_step"] == 3
        torch.save(sched, folder / "lr_scheduler_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt")
        p = torch.nn.Parameter(torch.zeros(2))
        optimizer, scheduler = build_optimizer(
            [("norm.weight", p)], cfg, RunLayout.of(cfg), torch.device("cpu")
        )
        _load_scheduler(tmp_path, scheduler, optimizer, RunLayout.of(cfg))
        assert (scheduler.last_epoch, scheduler._step_count) == (3, 4)
        kw = schedule_kwargs(cfg)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(3, **kw))
