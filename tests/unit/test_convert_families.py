"""`python -m mesh3d.convert` for the Qwen2 and Starcoder2 families: Hugging Face
Qwen2ForCausalLM (biases, a sliding window, linear rope interpolation), SmolLM3ForCausalLM (NoPE
layers) and Starcoder2ForCausalLM (multi-query, grouped-query with a window), both ways:
bitwise round trips, and mesh3d's logits equal transformers' on the converted weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.errors import UserError
from mesh3d.models.registry import spec_of

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")

SIZES = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=4, rms_norm_eps=1e-5,
             max_position_embeddings=64)  # fmt: skip


def _save(model, path):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


def qwen2(path, **kw):
    cfg = transformers.Qwen2Config(**SIZES, **kw)
    return _save(transformers.Qwen2ForCausalLM(cfg), path)


def smollm3(path, **kw):
    ids = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # its defaults are 128k+
    cfg = transformers.SmolLM3Config(**SIZES, **ids, **kw)
    return _save(transformers.SmolLM3ForCausalLM(cfg), path)


def starcoder2(path, **kw):
    sizes = {k: v for k, v in SIZES.items() if k not in ("rms_norm_eps", "num_key_value_heads")}
    cfg = transformers.Starcoder2Config(**sizes, norm_epsilon=1e-5, bos_token_id=0,
                                        eos_token_id=0, **kw)  # fmt: skip
    return _save(transformers.Starcoder2ForCausalLM(cfg), path)


CASES = {
    "qwen2 untied": (qwen2, dict(tie_word_embeddings=False)),
    "qwen2 tied, sliding window": (
        qwen2, dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
                    max_window_layers=0)),
    "qwen2 linear rope interpolation": (
        qwen2, dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "smollm3 NoPE every 2nd layer": (smollm3, dict(no_rope_layer_interval=2)),
    "starcoder2 multi-query": (starcoder2, dict(num_key_value_heads=1)),
    "starcoder2 grouped-query, sliding window": (
        starcoder2, dict(num_key_value_heads=2, sliding_window=5)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_bitwise_and_logits_equal_transformers(tmp_path, case):
    make, kw = CASES[case]
    hf = make(tmp_path / "hf", **kw)
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=2, pp=2)
    mc = convert.read_model_config_json(tmp_path / "nt")
    spec = spec_of(mc)
    assert spec.hf_of(mc).architectures[0] == type(hf).__name__
    ours = spec.build(mc, attention="sdpa").eval()
    full = read_nanotron_weights(tmp_path / "nt" / "model", convert.shape_of(mc))
    missing, unexpected = ours.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)[..., :101]
    err = float((got - expected).abs().max() / expected.abs().max())
    print(f"{case}: max relative error {err:.2e}")
    assert err <= 1e-5
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    a, b = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    padded = {
        k: b[k][: a[k].shape[0]] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else b[k]
        for k in b
    }
    assert set(a) == set(padded)
    assert all(torch.equal(a[k], padded[k]) for k in a), "round trip changed a tensor"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert torch.equal(back(ids).logits[..., :101], expected)


def test_mesh3d_qwen2_without_bias_gets_zero_biases_in_hf(tmp_path):
    """HF Qwen2 always has q/k/v biases: a model trained without them converts with zeros."""
    qwen2(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    mcj = tmp_path / "nt" / "model_config.json"
    d = json.loads(mcj.read_text())
    assert d["attention_bias"] is True and d["is_qwen2_config"] is True
    # the same model with its biases dropped, as mesh3d would have trained it
    for f in (tmp_path / "nt" / "model").rglob("model_bias*.safetensors"):
        f.unlink()
    mcj.write_text(json.dumps({**d, "attention_bias": False}))
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    w = load_file(tmp_path / "back" / "model.safetensors")
    assert not w["model.layers.0.self_attn.q_proj.bias"].any()


def test_what_cannot_convert_is_refused(tmp_path):
    qwen2(tmp_path / "hf", use_sliding_window=True, sliding_window=5, max_window_layers=2)
    with pytest.raises(UserError, match="a sliding window on some layers only"):
        convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    smollm3(tmp_path / "s", no_rope_layers=[1, 0, 0, 1])
    with pytest.raises(UserError, match="no_rope_layer is every k-th layer"):
        convert.from_hf(tmp_path / "s", tmp_path / "nt2")


def test_what_starcoder2_cannot_convert_is_refused(tmp_path):
    starcoder2(tmp_path / "hf", use_bias=False)
    with pytest.raises(UserError, match="`use_bias: false`"):
        convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    starcoder2(tmp_path / "hf2", num_key_value_heads=2, sliding_window=5)
    convert.from_hf(tmp_path / "hf2", tmp_path / "nt2")
    mcj = tmp_path / "nt2" / "model_config.json"
    d = json.loads(mcj.read_text())
    assert d["grouped_query"] and d["num_kv_heads"] == 2 and d["sliding_window_size"] == 5
    mcj.write_text(json.dumps({**d, "global_attn_layers": [1]}))  # HF slides every layer
    with pytest.raises(UserError, match="global_attn_layers with a sliding window"):
        convert.to_hf(tmp_path / "nt2", tmp_path / "back")
