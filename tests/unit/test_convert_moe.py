"""`python -m mesh3d.convert` for Qwen2 and Qwen3 with a `moe_config`, as Hugging Face's
`Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM` (no shared expert, `norm_topk_prob` on and off),
both ways: mesh3d's logits equal transformers' on the converted weights, HF -> mesh3d -> HF is
bitwise, both on-disk expert forms are read (per expert, what `save_pretrained` writes and the
Hub holds; stacked, transformers 5's in-memory form), and a mesh3d-trained MoE checkpoint
converts. What HF's MoE models cannot express is refused.

The tests of this subject that need a process group are in
`tests/ranks/test_convert_moe_ranks.py`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.config.other_families import MoEConfig, Qwen3Config
from mesh3d.errors import UserError
from mesh3d.models.registry import spec_of

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) not installed")

VOCAB = 101
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=3, rms_norm_eps=1e-5,
             max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32)  # fmt: skip
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def qwen2_moe(path, **kw):
    cfg = transformers.Qwen2MoeConfig(**{**SIZES, "shared_expert_intermediate_size": 48, **kw})
    return _random_saved(transformers.Qwen2MoeForCausalLM(cfg), path)


def qwen3_moe(path, **kw):
    cfg = transformers.Qwen3MoeConfig(**{**SIZES, "head_dim": 32, **kw})  # 4 heads x 32 > 64
    return _random_saved(transformers.Qwen3MoeForCausalLM(cfg), path)


def _random_saved(model, path):
    """`model` with random fp32 weights, saved with `save_pretrained` (router weights spread
    wide enough that the top-k choice is clear of ties)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(
                base + (0.5 if name.endswith("mlp.gate.weight") else 0.05) * torch.randn_like(p)
            )
    model.save_pretrained(path)
    return model.eval()


def mesh3d_logits(step, ids=IDS):
    """Logits of the mesh3d model a step folder holds (real vocabulary columns)."""
    mc = convert.read_model_config_json(step)
    ours = spec_of(mc).build(mc, attention="sdpa").eval()
    full = read_nanotron_weights(step / "model", convert.shape_of(mc))
    missing, unexpected = ours.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        return ours(ids)[..., :VOCAB]


def rel_err(got, expected) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


CASES = {
    "dense layer 1, untied": (qwen2_moe, dict(mlp_only_layers=[1])),
    "every layer MoE, tied, sliding window": (qwen2_moe, dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
        layer_types=["sliding_attention"] * 3)),
    "sparse step 2": (qwen2_moe, dict(decoder_sparse_step=2, num_hidden_layers=4)),
    "qwen3: norm_topk_prob, dense layer 1, untied": (
        qwen3_moe, dict(norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3: top-k as is, tied, sliding window, sparse step 2": (qwen3_moe, dict(
        norm_topk_prob=False, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=5, decoder_sparse_step=2, num_hidden_layers=4)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_hf_round_trip_bitwise_and_logits_equal_transformers(tmp_path, case):
    make, kw = CASES[case]
    hf = make(tmp_path / "hf", **kw)
    on_disk = load_file(tmp_path / "hf" / "model.safetensors")
    assert any(k.endswith("mlp.experts.3.gate_proj.weight") for k in on_disk)  # as the Hub
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=1, pp=2)
    mc = convert.read_model_config_json(tmp_path / "nt")
    assert mc.moe_config.enable_shared_expert == (make is qwen2_moe)
    assert getattr(mc, "norm_topk_prob", False) == kw.get("norm_topk_prob", False)
    expected = hf(IDS).logits.detach()
    got = mesh3d_logits(tmp_path / "nt")
    err = rel_err(got, expected)
    print(f"{case}: HF -> mesh3d max logit difference {(got - expected).abs().max():.2e} "
          f"(relative {err:.2e})")  # fmt: skip
    assert err <= 1e-5

    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    back_w = load_file(tmp_path / "back" / "model.safetensors")
    padded = {
        k: v[:VOCAB] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v
        for k, v in back_w.items()
    }
    assert set(on_disk) == set(padded)
    assert all(torch.equal(on_disk[k], padded[k]) for k in on_disk), "round trip changed a tensor"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        got = back(IDS).logits[..., :VOCAB]
    print(f"{case}: mesh3d -> HF max relative logit error {rel_err(got, expected):.2e}")
    assert torch.equal(got, expected)
    assert back.config.norm_topk_prob == kw.get("norm_topk_prob", False)


def test_stacked_experts_on_disk_convert_the_same(tmp_path):
    """transformers 5 also loads the in-memory form (`experts.gate_up_proj` [E, 2F, h]) from
    disk; from-hf reads it to the same checkpoint as the per-expert form."""
    hf = qwen2_moe(tmp_path / "hf", mlp_only_layers=[1])
    (tmp_path / "stacked").mkdir()
    (tmp_path / "stacked" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    save_file(state, str(tmp_path / "stacked" / "model.safetensors"), metadata={"format": "pt"})
    convert.from_hf(tmp_path / "hf", tmp_path / "a")
    convert.from_hf(tmp_path / "stacked", tmp_path / "b")
    mc = convert.read_model_config_json(tmp_path / "a")
    a, b = (read_nanotron_weights(tmp_path / d / "model", convert.shape_of(mc)) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    err = rel_err(mesh3d_logits(tmp_path / "b"), hf(IDS).logits.detach())
    print(f"stacked on disk: max relative logit error {err:.2e}")
    assert err <= 1e-5


def test_moe_layers_map_to_mlp_only_layers(tmp_path):
    qwen2_moe(tmp_path / "hf", decoder_sparse_step=2, num_hidden_layers=4, mlp_only_layers=[3])
    convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    d = json.loads((tmp_path / "nt" / "model_config.json").read_text())
    assert d["moe_config"]["layers"] == [1] and d["moe_config"]["top_k"] == 2
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [0, 2, 3] and cfg["decoder_sparse_step"] == 1
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["norm_topk_prob"] is False


def test_what_cannot_convert_is_refused(tmp_path):
    qwen2_moe(tmp_path / "hf", norm_topk_prob=True)
    with pytest.raises(UserError, match="norm_topk_prob"):
        convert.from_hf(tmp_path / "hf", tmp_path / "nt")
    qwen2_moe(tmp_path / "ok")
    convert.from_hf(tmp_path / "ok", tmp_path / "nt2")
    mcj = tmp_path / "nt2" / "model_config.json"
    d = json.loads(mcj.read_text())
    d["moe_config"]["enable_shared_expert"] = False
    mcj.write_text(json.dumps(d))
    for d in list((tmp_path / "nt2" / "model").rglob("shared_expert*")):
        shutil.rmtree(d, ignore_errors=True)  # as mesh3d would have saved it
    with pytest.raises(UserError, match=r"moe_config\.enable_shared_expert"):
        convert.to_hf(tmp_path / "nt2", tmp_path / "back")
    qwen3_moe(tmp_path / "biased", attention_bias=True)  # HF's bias covers o_proj too
    with pytest.raises(UserError, match="attention_bias"):
        convert.from_hf(tmp_path / "biased", tmp_path / "nt3")
    shared = Qwen3Config(moe_config=MoEConfig(enable_shared_expert=True))
    with pytest.raises(UserError, match=r"enable_shared_expert: true.*no shared expert"):
        spec_of(shared).hf_of(shared).config_to_hf(shared, "float32")
