"""The single-device Llama and its layout-invariant init: shapes, causality, init rules, tying,
and logits parity with Hugging Face `LlamaForCausalLM` (fp32, CPU)."""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from mesh3d.models import llama as llama_mod
from mesh3d.models.init import init_full_tensor, init_weights, param_seed
from mesh3d.models.llama import Llama, num_params
from mesh3d.models.llama_spec import init_std as llama_init_std

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_cfg(**overrides) -> SimpleNamespace:
    """Nanotron LlamaConfig key names; GQA (4 query heads, 2 kv heads), head_dim 16."""
    cfg = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        rope_interleaved=False,
        tie_word_embeddings=False,
        vocab_size=101,
        hidden_act="silu",
        max_position_embeddings=32,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def build(cfg, seed=42, std=0.02, vocab_size=None) -> Llama:
    """Meta construction, materialization and init: the path training takes."""
    with torch.device("meta"):
        model = Llama(cfg, vocab_size=vocab_size, attention="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=std, num_layers=cfg.num_hidden_layers, seed=seed)
    return model


# --- forward ---------------------------------------------------------------------------------


def test_forward_shapes_and_padded_vocab():
    ids = torch.randint(0, 101, (2, 16))
    assert build(tiny_cfg())(ids).shape == (2, 16, 101)
    padded = build(tiny_cfg(), vocab_size=128)
    assert padded.embed_tokens.weight.shape == (128, 64)
    assert padded(ids).shape == (2, 16, 128)


def test_pipeline_stage_pieces_are_skipped():
    model = build(tiny_cfg())
    ids = torch.randint(0, 101, (2, 8))
    full = model(ids)
    hidden = model.embed_tokens(ids)
    model.embed_tokens = None
    torch.testing.assert_close(model(hidden), full)  # a later stage takes hidden states
    model.norm, model.lm_head = None, None
    assert model(hidden).shape == (2, 8, 64)


def test_causal_masking():
    model = build(tiny_cfg()).eval()
    ids = torch.randint(0, 101, (1, 16))
    t = 9
    changed = ids.clone()
    changed[0, t] = (ids[0, t] + 1) % 101
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4


def test_unknown_activation_names_the_key():
    with pytest.raises(ValueError, match=r"model\.model_config\.hidden_act.*'swiglu_x'.*silu"):
        Llama(tiny_cfg(hidden_act="swiglu_x"))


def test_flash_requested_without_flash_attn_says_how_to_fix():
    if llama_mod.flash_attn_func is not None:
        pytest.skip("flash-attn is installed")
    with pytest.raises(ImportError, match="pip install flash-attn"):
        Llama(tiny_cfg(), attention="flash")


# --- init --------------------------------------------------------------------------------------


def test_init_is_seeded_per_parameter_name():
    cfg = tiny_cfg()
    a, b, c = build(cfg, seed=7), build(cfg, seed=7), build(cfg, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not torch.equal(
        sa["layers.0.self_attn.q_proj.weight"], sc["layers.0.self_attn.q_proj.weight"]
    )
    assert param_seed(7, "x") == param_seed(7, "x") != param_seed(7, "y")

    with torch.device("meta"):
        stage = Llama(cfg)
    del stage.layers["1"]
    stage.embed_tokens = None
    stage.to_empty(device="cpu")
    init_weights(stage, std=0.02, num_layers=cfg.num_hidden_layers, seed=7)
    for name, p in stage.named_parameters():
        assert torch.equal(p, sa[name]), name


def test_init_std_rules():
    cfg = tiny_cfg(hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    model = build(cfg, std=0.1)
    params = dict(model.named_parameters())
    for name in (
        "layers.3.input_layernorm.weight",
        "layers.3.post_attention_layernorm.weight",
        "norm.weight",
    ):
        assert torch.equal(params[name], torch.ones(256))
    expect = {
        "layers.3.mlp.down_proj.weight": 0.1 / math.sqrt(16),
        "layers.3.self_attn.o_proj.weight": 0.1 / math.sqrt(16),
        "layers.3.mlp.gate_proj.weight": 0.1,
        "layers.3.self_attn.q_proj.weight": 0.1,
        "embed_tokens.weight": 0.1,
        "lm_head.weight": 0.1,
    }
    for name, std in expect.items():
        assert params[name].std().item() == pytest.approx(std, rel=0.03), name
        assert params[name].mean().abs().item() < 0.05 * std, name
    assert llama_init_std("layers.0.mlp.down_proj.weight", 0.1, 8, "NONE") == 0.1
    assert llama_init_std("layers.0.mlp.down_proj.bias", 0.1, 8) == 0.0
    with pytest.raises(ValueError, match="scaling_method"):
        llama_init_std("layers.0.mlp.down_proj.weight", 0.1, 8, "LAYER_INDEX")
    half = init_full_tensor("w", (4, 4), 0.02, 1, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, init_full_tensor("w", (4, 4), 0.02, 1).to(torch.bfloat16))


def test_tied_embeddings_stay_one_tensor():
    cfg = tiny_cfg(tie_word_embeddings=True)
    model = build(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert num_params(model) == sum(
        p.numel() for n, p in model.state_dict().items() if n != "lm_head.weight"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 101, (2, 8))).square().mean().backward()
    opt.step()
    assert model.lm_head.weight is model.embed_tokens.weight
    # The last pipeline stage holding only the head gets the embedding's initial values.
    with torch.device("meta"):
        last = Llama(cfg)
    last.embed_tokens = None
    last.to_empty(device="cpu")
    init_weights(last, std=0.02, num_layers=2)
    torch.testing.assert_close(last.lm_head.weight, build(cfg).embed_tokens.weight, rtol=0, atol=0)


# --- parity with Hugging Face transformers ----------------------------------------------------


def hf_model(cfg, rope_scaling=None):
    """`LlamaForCausalLM` with `cfg`'s shapes and random weights (norms too), fp32, eval."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers (dev extra) not installed"
    )
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_hidden_layers=cfg.num_hidden_layers,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        rope = dict(rope_scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
        kwargs["rope_parameters"] = rope  # transformers >= 5
    else:
        kwargs.update(rope_theta=cfg.rope_theta, rope_scaling=rope_scaling)
    hf_cfg = transformers.LlamaConfig(**kwargs)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if name.endswith("norm.weight")
                else 0.05 * torch.randn_like(p)
            )
    return model


def to_ours(hf, cfg, permute_qk=False) -> Llama:
    """Our model holding `hf`'s weights ("model.X" -> "X"); GPT-J row order if `permute_qk`."""
    ours = Llama(cfg, attention="sdpa").eval()
    dh = cfg.hidden_size // cfg.num_attention_heads
    # per head: new row 2i = old row i, new row 2i+1 = old row i + dh/2
    # (docs/nanotron-layout.md#rotary-layouts)
    perm = torch.stack([torch.arange(dh // 2), torch.arange(dh // 2) + dh // 2], dim=-1).flatten()
    state = {}
    for name, t in hf.state_dict().items():
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = t.view(-1, dh, t.shape[-1])[:, perm].reshape(t.shape)
        state[name.removeprefix("model.")] = t
    ours.load_state_dict(state)
    return ours


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


PARITY_CASES = {
    "gqa_untied": (dict(), None),
    "tied_gelu_tanh": (dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"), None),
    "llama3_scaling": (dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING), LLAMA3_SCALING),
    "theta_500k_interleaved": (dict(rope_theta=500000.0, rope_interleaved=True), None),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_logits_match_hf(case):
    overrides, scaling = PARITY_CASES[case]
    cfg = tiny_cfg(**overrides)
    hf = hf_model(cfg, scaling)
    ours = to_ours(hf, cfg, permute_qk=cfg.rope_interleaved)
    if cfg.tie_word_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    err = rel_err(got, expected)
    print(f"{case}: max relative error {err:.2e}")
    assert err <= 1e-5
    if scaling is not None:  # the scaling must matter at S=24 > 16, in HF and in ours
        unscaled = hf_model(tiny_cfg(**dict(overrides, rope_scaling=None)))
        with torch.no_grad():
            assert rel_err(unscaled(ids).logits, expected) > 1e-3
