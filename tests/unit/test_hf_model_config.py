"""`mesh3d.hf_model` in a config: the model section read from the folder's config.json
(`mesh3d/config/hf_model.py`), and what such a run cannot do yet refused in one line naming
the key."""

from __future__ import annotations

import pytest

from mesh3d.config import load_config
from mesh3d.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="mesh3d.hf_model needs transformers")

CONFIG = "recipes/configs/cpu_tiny.yaml"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gemma2"
    transformers.Gemma2Config(vocab_size=384, hidden_size=48, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_hidden_layers=3, max_position_embeddings=96).save_pretrained(path)  # fmt: skip
    return path


def test_the_model_section_comes_from_the_folder(folder):
    cfg = load_config(CONFIG, [f"mesh3d.hf_model={folder}"])
    mc = cfg.model.model_config
    assert (mc.vocab_size, mc.hidden_size, mc.num_hidden_layers) == (384, 48, 3)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size) == (4, 2, 96)
    assert mc.max_position_embeddings == 96 and mc.tie_word_embeddings  # Gemma 2 ties them
    assert cfg.model.make_vocab_size_divisible_by == 1
    assert cfg.mesh3d.hf_model == str(folder)


@pytest.mark.parametrize(
    "overrides,starts",
    [(["mesh3d.lora={r: 4}"], "`mesh3d.lora`: LoRA adapters is not supported"),
     (["mesh3d.compile=true"], "`mesh3d.compile`:"),
     (["mesh3d.hf_export=true"], "`mesh3d.hf_export`: the in-run export"),
     (["parallelism.context_parallel_size=2", "parallelism.pp=2"],
      "`parallelism.context_parallel_size`: with pp > 1"),
     (["parallelism.expert_parallel_size=2"], "`parallelism.expert_parallel_size`: 2 must"),
     (["parallelism.pp=2", "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
      "`parallelism.tp_mode`: REDUCE_SCATTER")],
)  # fmt: skip
def test_what_it_cannot_do_yet_is_refused_in_one_line(folder, overrides, starts):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [f"mesh3d.hf_model={folder}", *overrides])
    message = str(e.value)
    assert starts in message and "\n" not in message, message
    key = starts.split("`")[1]  # blamed on the override that set that key
    assert message.startswith(f"override {next(o for o in overrides if o.startswith(key))!r}: ")


def test_a_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="neither a folder holding a transformers config.json"):
        load_config(CONFIG, [f"mesh3d.hf_model={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError) as e:  # a folder, but no model in it
        load_config(CONFIG, [f"mesh3d.hf_model={tmp_path}"])
    assert str(e.value).endswith("nor a hub id (it has no config.json)"), e.value


def test_an_unknown_hub_id_offline_is_refused_at_once(monkeypatch):
    """Without network, a hub id not in the cache is refused without the hub client's retries."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://no-such-host.invalid")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, ["mesh3d.hf_model=no-such-org/no-such-model"])
    assert "not in the hub cache, and the hub cannot be reached from here" in str(e.value)
    assert str(e.value).startswith("override 'mesh3d.hf_model=no-such-org/no-such-model': ")
    assert time.perf_counter() - start < 10
