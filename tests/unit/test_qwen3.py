"""Qwen3 through the `mesh3d:` extension (Nanotron has no Qwen3): a Qwen2 model_config with
`mesh3d: {model_family: qwen3, head_dim: ...}` trains with q/k norms and a free head size at
every layout like one process, and converts to and from HF `Qwen3ForCausalLM` exactly.

The tests of this subject that need a process group are in `tests/ranks/test_qwen3_ranks.py`."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from parity import TINY
from safetensors.torch import load_file

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import model_config_json, read_nanotron_weights
from mesh3d.checks import validate
from mesh3d.config import Qwen3Config, config_from_dict, config_to_dict, load_config
from mesh3d.config.load import model_config_from_dict, nanotron_config_dict
from mesh3d.errors import ConfigError
from mesh3d.models.registry import spec_of

QWEN3 = copy.deepcopy(TINY)
_mc = QWEN3["model"]["model_config"]
_mc.pop("is_llama_config")
_mc.update(is_qwen2_config=True)
QWEN3["mesh3d"].update(model_family="qwen3", head_dim=16)  # 8 heads x 16 > hidden 64


def test_yaml_form_keeps_nanotrons_schema():
    cfg = config_from_dict(copy.deepcopy(QWEN3))
    mc = cfg.model.model_config
    assert type(mc) is Qwen3Config and mc.head_dim == 16 and spec_of(mc).family == "qwen3"
    d = config_to_dict(cfg)
    assert (
        "head_dim" not in d["model"]["model_config"]
        and d["model"]["model_config"]["is_qwen2_config"]
    )
    assert d["mesh3d"]["model_family"] == "qwen3" and config_from_dict(d) == cfg
    bad = copy.deepcopy(QWEN3)
    bad["mesh3d"]["head_dim"] = 15
    with pytest.raises(ConfigError, match=r"`mesh3d.head_dim` \(15\) must be an even number"):
        validate(config_from_dict(bad))
    llama = copy.deepcopy(TINY)
    llama["mesh3d"]["head_dim"] = 16
    with pytest.raises(
        ConfigError, match="`mesh3d.head_dim` is only for `mesh3d.model_family: qwen3`"
    ):
        validate(config_from_dict(llama))


def test_model_config_json_form_is_saved_with_its_family_in_mesh3d():
    """A model_config with `is_qwen3_config` (mesh3d's model_config.json form, which `convert
    from-hf` puts in its config.yaml) is saved as Nanotron's Qwen2 one plus `mesh3d:`, and
    loads back as the same Qwen3."""
    d = copy.deepcopy(QWEN3)
    del d["mesh3d"]["model_family"], d["mesh3d"]["head_dim"]
    d["model"]["model_config"].update(is_qwen3_config=True, head_dim=16)
    cfg = config_from_dict(d)
    assert cfg.mesh3d.model_family == "qwen3" and cfg.mesh3d.head_dim == 16
    assert config_from_dict(config_to_dict(cfg)) == cfg
    d["mesh3d"]["head_dim"] = 32
    with pytest.raises(ConfigError, match=r"`mesh3d.head_dim` \(32\) differs"):
        config_from_dict(d)


def test_norm_topk_prob_is_a_mesh3d_setting_of_qwen3_moe():
    """`mesh3d.norm_topk_prob` (Nanotron's moe_config has no such key): in the loaded Qwen3
    config and its model_config.json, not in Nanotron's model_config; only with experts."""
    d = copy.deepcopy(QWEN3)
    d["model"]["model_config"]["moe_config"] = dict(
        num_experts=4, top_k=2, moe_intermediate_size=32
    )
    d["mesh3d"]["norm_topk_prob"] = True
    cfg = config_from_dict(d)
    validate(cfg)
    assert cfg.model.model_config.norm_topk_prob
    saved = config_to_dict(cfg)
    assert saved["mesh3d"]["norm_topk_prob"] and config_from_dict(saved) == cfg
    for mc in (saved["model"]["model_config"], nanotron_config_dict(cfg)["model"]["model_config"]):
        assert "norm_topk_prob" not in mc and "norm_topk_prob" not in mc["moe_config"]
    written = model_config_json(cfg)
    assert written["norm_topk_prob"] is True
    assert model_config_from_dict(written) == dataclasses.replace(
        cfg.model.model_config, vocab_size=written["vocab_size"]
    )
    no_experts = copy.deepcopy(QWEN3)
    no_experts["mesh3d"]["norm_topk_prob"] = True
    qwen2 = copy.deepcopy(d)
    del qwen2["mesh3d"]["model_family"], qwen2["mesh3d"]["head_dim"]
    for bad in (no_experts, qwen2):
        with pytest.raises(ConfigError, match="`mesh3d.norm_topk_prob` is only for"):
            validate(config_from_dict(bad))


transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")


def test_hf_qwen3_round_trip_and_logits(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   num_hidden_layers=4, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=2, pp=2)
    d = json.loads((tmp_path / "nt" / "model_config.json").read_text())
    assert d["is_qwen3_config"] is True and d["head_dim"] == 32
    yaml_mc = load_config(tmp_path / "nt" / "config.yaml").model.model_config
    assert type(yaml_mc) is Qwen3Config and yaml_mc.head_dim == 32
    mc = convert.read_model_config_json(tmp_path / "nt")
    ours = spec_of(mc).build(mc, attention="sdpa").eval()
    full = read_nanotron_weights(tmp_path / "nt" / "model", convert.shape_of(mc))
    assert (
        tmp_path / "nt/model/model/decoder/0/pp_block/attn/q_norm/model_weight.safetensors"
    ).is_file()
    ours.load_state_dict(full, strict=False)
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf.eval()(ids).logits, ours(ids)[..., :101]
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    a, b = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k][: a[k].shape[0]]) for k in a)
