"""SFT from `model.init_method.path` (a mesh3d/Nanotron step folder or an HF folder): a
tokenizer with more ids than the checkpoint's vocabulary, or whose EOS id lies outside it, is
refused with one line naming the files, the numbers and the fix
(`checkpoint/hf_run.py::check_init_tokenizer`, called by `train/run.py` before the data is read).
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from data_fixtures import make_tokenizer
from parity import TINY

from mesh3d.checkpoint.hf_run import check_init_tokenizer, checkpoint_vocab
from mesh3d.config import ExistingCheckpointInit, apply_overrides, config_from_dict
from mesh3d.data.tokenize import load_tokenizer
from mesh3d.errors import UserError
from mesh3d.train.run import _check_sft_tokenizer


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """300 ids ('</s>' inside); the same with two added tokens (302); a word-level tokenizer
    of 10 ids whose EOS '<|endoftext|>' is added last (id 10)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("toks")
    base = make_tokenizer(root / "base", vocab_size=300).parent
    t = Tokenizer.from_file(str(base / "tokenizer.json"))
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    (root / "more").mkdir()
    t.save(str(root / "more" / "tokenizer.json"))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens(["<|endoftext|>"])
    (root / "eos_last").mkdir()
    words.save(str(root / "eos_last" / "tokenizer.json"))
    return root


def _step(path, vocab: int, config_yaml: bool):
    """A step folder: model/ and model_config.json (padded vocab), config.yaml when asked."""
    (path / "model").mkdir(parents=True)
    (path / "model_config.json").write_text(json.dumps({"vocab_size": -(-vocab // 8) * 8}))
    if config_yaml:
        (path / "config.yaml").write_text(yaml.safe_dump({"model": {"model_config": {
            "vocab_size": vocab}}}))  # fmt: skip
    return path


def test_checkpoint_vocab_from_each_kind_of_folder(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 301}))
    assert checkpoint_vocab(hf) == (301, str(hf / "config.json"))
    step = _step(tmp_path / "s1" / "7", 301, config_yaml=True)
    assert checkpoint_vocab(step) == (301, str(step / "config.yaml"))
    assert checkpoint_vocab(step / "model") == (301, str(step / "config.yaml"))
    bare = _step(tmp_path / "s2" / "7", 301, config_yaml=False)  # Nanotron's padded 304
    assert checkpoint_vocab(bare) == (304, str(bare / "model_config.json"))
    assert checkpoint_vocab(tmp_path / "nothing") == (None, "")


def test_tokenizer_past_the_checkpoint_vocabulary_is_refused(toks, tmp_path):
    step = _step(tmp_path / "7", 300, config_yaml=True)
    assert load_tokenizer(toks / "base").get_vocab_size(with_added_tokens=True) == 300
    check_init_tokenizer(str(step), str(toks / "base"))  # fits: no error
    with pytest.raises(UserError) as e:
        check_init_tokenizer(str(step), str(toks / "more"))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"tokenizer {str(toks / 'more')!r} has 302 ids (with added tokens)" in msg
    assert f"model.init_method.path {step} has a vocabulary of 300 ids" in msg
    assert str(step / "config.yaml") in msg and "tokenizer.tokenizer_name_or_path" in msg

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(UserError) as e:
        check_init_tokenizer(str(hf), str(toks / "eos_last"))
    msg = str(e.value)
    assert "\n" not in msg
    assert "its EOS token '<|endoftext|>' is id 10, outside the 10 ids of" in msg
    assert str(hf / "config.json") in msg and "tokenizer the checkpoint was trained with" in msg


def test_the_run_checks_sft_from_a_checkpoint_only(toks, tmp_path):
    step = _step(tmp_path / "7", 300, config_yaml=True)
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    stage = (f"data_stages=[{{name: sft, start_training_step: 1, data: {{dataset: "
             f"{{hf_dataset_or_datasets: {tmp_path / 'd.jsonl'}, sft_dataloader: true}}}}}}]")  # fmt: skip
    cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), [
        f"tokenizer.tokenizer_name_or_path={toks / 'more'}", stage])  # fmt: skip
    _check_sft_tokenizer(cfg)  # random init: nothing to check against
    cfg.model.init_method = ExistingCheckpointInit(path=str(step))
    with pytest.raises(UserError, match="has 302 ids"):
        _check_sft_tokenizer(cfg)
    cfg.data_stages = None  # pretraining (dummy data): not checked here
    _check_sft_tokenizer(cfg)
