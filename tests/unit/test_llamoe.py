"""LlaMoE (Nanotron's examples/moe): its example config passes `mesh3d config` as written; the
single-device model equals a reference written here from the example's math (a plain loop over
tokens and their experts: softmax router, top k weights as they are, w2(gelu_tanh(w1 x)) experts,
Llama attention with interleaved RoPE), in logits and over AdamW steps; the checkpoint names
and the init.

The tests that need a process group are in `tests/ranks/test_llamoe_ranks.py`."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import TINY

from mesh3d.checkpoint.nanotron_weights import nanotron_params, nanotron_shards
from mesh3d.config import config_from_dict
from mesh3d.config.llamoe import LlaMoEConfig
from mesh3d.errors import ConfigError
from mesh3d.models.init import init_weights
from mesh3d.models.registry import model_shape, spec_of

EXAMPLE = Path(__file__).parents[1] / "configs" / "nanotron_llamoe_example.yaml"
VOCAB = 102
LLAMOE = copy.deepcopy(TINY)
LLAMOE["model"]["model_config"] = dict(
    is_llamoe_config=True, hidden_size=32, intermediate_size=24, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB, moe_num_experts=4,
    num_experts_per_tok=2, max_position_embeddings=8,
)  # fmt: skip


def test_nanotrons_example_config_passes_mesh3d_config(capsys):
    from mesh3d.checks.__main__ import main

    main([str(EXAMPLE)])  # exits 2 on any problem
    out = capsys.readouterr()
    assert "is_llamoe_config: true" in out.out and "moe_num_experts: 4" in out.out
    # its ep 2 over dp 1: every rank holds every expert, said once
    assert "`parallelism.expert_parallel_size` (2) does not divide `parallelism.dp` (1)" in (
        out.out + out.err
    )
    cfg = config_from_dict(copy.deepcopy(LLAMOE))
    assert type(cfg.model.model_config) is LlaMoEConfig
    assert spec_of(cfg.model.model_config).family == "llamoe"
    with pytest.raises(ConfigError, match="no Hugging Face class exists for LlaMoE"):
        spec_of(cfg.model.model_config).hf_of(cfg.model.model_config)


def _model(seed: int = 0):
    cfg = config_from_dict(copy.deepcopy(LLAMOE))
    mc = cfg.model.model_config
    spec = spec_of(mc)
    model = spec.build(mc, vocab_size=VOCAB)
    init_weights(model, 0.05, mc.num_hidden_layers, seed=seed, init_std_fn=spec.init_std)
    return mc, model


# ---------------------------------------------------------------- the reference, from the example


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_interleaved(x, positions, theta=10000.0):
    """x [B, S, n, d]: dims (2i, 2i+1) rotated by position · theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[..., None].double() * freqs  # [B, S, d/2]
    rot = torch.polar(torch.ones_like(angle), angle)[:, :, None, :]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * rot).reshape(x.shape).to(x.dtype)


def _attention(x, p, pre, mc):
    b, s, _ = x.shape
    nq, nkv = mc.num_attention_heads, mc.num_key_value_heads
    dh = mc.hidden_size // nq
    positions = torch.arange(s).expand(b, s)
    q = (x @ p[pre + "q_proj.weight"].T).view(b, s, nq, dh)
    k = (x @ p[pre + "k_proj.weight"].T).view(b, s, nkv, dh)
    v = (x @ p[pre + "v_proj.weight"].T).view(b, s, nkv, dh)
    q, k = _rope_interleaved(q, positions), _rope_interleaved(k, positions)
    k, v = k.repeat_interleave(nq // nkv, dim=2), v.repeat_interleave(nq // nkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, nq * dh)
    return out @ p[pre + "o_proj.weight"].T


def _moe(x, p, pre, mc):
    """The example's dMoE, one token and one chosen expert at a time."""
    f, k = mc.intermediate_size, mc.num_experts_per_tok
    flat = x.reshape(-1, x.shape[-1])
    scores = F.softmax(flat @ p[pre + "gate.weight"].T, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(scores, k, dim=-1)
    rows = []
    for t in range(flat.shape[0]):
        row = torch.zeros_like(flat[t])
        for j in range(k):
            e = int(chosen[t, j])
            w1 = p[pre + "experts.w1"][e * f : (e + 1) * f]  # [F, h]
            w2 = p[pre + "experts.w2"][e * f : (e + 1) * f]  # [F, h]
            hidden = F.gelu(w1 @ flat[t], approximate="tanh")
            row = row + weights[t, j] * (hidden @ w2)
        rows.append(row)
    return torch.stack(rows).view_as(x)


def reference(p: dict, ids, mc):
    x = p["embed_tokens.weight"][ids]
    for i in range(mc.num_hidden_layers):
        pre = f"layers.{i}."
        x = x + _attention(_rms(x, p[pre + "input_layernorm.weight"], mc.rms_norm_eps), p,
                           pre + "self_attn.", mc)  # fmt: skip
        h = _rms(x, p[pre + "post_attention_layernorm.weight"], mc.rms_norm_eps)
        x = x + _moe(h, p, pre + "mlp.", mc)
    return _rms(x, p["norm.weight"], mc.rms_norm_eps) @ p["lm_head.weight"].T


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_and_adamw_steps_equal_the_reference():
    """Same weights, same batches: logits, then four AdamW steps (loss and every weight)."""
    mc, model = _model()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = model(ids), reference(params, ids, mc)
    assert _max_rel(got, expected) <= 1e-5, _max_rel(got, expected)
    # eps 1e-6 (tests/helpers/parity.py says why): fp32 summation-order noise in a ~1e-8 gradient
    # would otherwise become ~1e-4 of its update
    opts = [torch.optim.AdamW(ps, lr=3e-3, eps=1e-6, weight_decay=0.01, foreach=False)
            for ps in (list(model.parameters()), list(params.values()))]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        batch = torch.randint(0, VOCAB, (3, 13), generator=gen)
        losses = []
        for run, opt in zip((model, lambda i: reference(params, i, mc)), opts):
            logits = run(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), losses
    # gradients agree to ~6e-7; Adam's g / (sqrt(v) + eps) lifts that in weights whose gradient is
    # tiny (experts few tokens reached) to ~4e-5 after four steps
    worst = max(_max_rel(p.detach(), params[n].detach()) for n, p in model.named_parameters())
    assert worst <= 1e-4, worst
    assert model.layers["0"].mlp.stats  # the load statistics the metrics read


def test_checkpoint_names_and_shards_are_the_examples():
    """Nanotron's names of the example's modules; w1, w2 [E·F, h] split on dim 0 over tp; the
    router one file without a rank suffix."""
    cfg = config_from_dict(copy.deepcopy(LLAMOE))
    shape = model_shape(cfg)
    names = [p.name for p in nanotron_params(shape, pp=2)]
    layer = "model.decoder.1.pp_block."
    assert names[1:8] == [
        "model.decoder.0.pp_block." + k for k in (
            "input_layernorm.weight", "attn.qkv_proj.weight", "attn.o_proj.weight",
            "post_attention_layernorm.weight", "block_sparse_moe.gate.layer.weight",
            "block_sparse_moe.experts.mlp.w1.module.weight",
            "block_sparse_moe.experts.mlp.w2.module.weight")
    ]  # fmt: skip
    _, model = _model()
    full = {k: v.detach() for k, v in model.state_dict().items()}
    files = nanotron_shards(full, shape, tp=2, pp=2)
    moe = layer.replace(".", "/") + "block_sparse_moe/"
    w1, meta = files[
        moe + "experts/mlp/w1/module/model_weight_pp-rank-0-of-2_tp-rank-1-of-2.safetensors"
    ]
    assert torch.equal(w1, full["layers.1.mlp.experts.w1"][48:])  # E·F = 96 rows, rank 1's half
    assert meta["unsharded_shape"] == "(96, 32)"
    assert torch.equal(
        files[moe + "gate/layer/model_weight.safetensors"][0], full["layers.1.mlp.gate.weight"]
    )


def test_init_is_the_examples():
    """Router and experts: PyTorch's linear default, uniform ±1/sqrt(h); attention as Llama's."""
    mc, model = _model(seed=3)
    bound = 1 / math.sqrt(mc.hidden_size)
    for name in ("gate.weight", "experts.w1", "experts.w2"):
        w = dict(model.named_parameters())[f"layers.0.mlp.{name}"]
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound, name
    o = model.layers["0"].self_attn.o_proj.weight
    assert abs(float(o.std()) - 0.05 / math.sqrt(2 * mc.num_hidden_layers)) < 0.005
