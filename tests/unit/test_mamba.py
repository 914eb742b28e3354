"""Mamba-1 (Nanotron's examples/mamba): its example config passes `mesh3d config` as written; the
single-device model equals transformers' `MambaForCausalLM` (slow path) in logits and over
AdamW steps from the same weights; HF conversion both ways through Nanotron's checkpoint
layout at tp 2 x pp 2; the init; the CUDA kernels against the plain scan where they run.

The tests that need a process group are in `tests/ranks/test_mamba_ranks.py`."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import TINY
from safetensors.torch import load_file

from mesh3d.checkpoint import hf as convert
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.config import config_from_dict
from mesh3d.config.mamba import MambaConfig, MambaSSMConfig
from mesh3d.models import mamba as mamba_model
from mesh3d.models.init import init_weights
from mesh3d.models.registry import spec_of

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).parents[1] / "configs" / "nanotron_mamba_example.yaml"
VOCAB = 101
MAMBA = copy.deepcopy(TINY)
MAMBA["model"]["model_config"] = dict(is_mamba_config=True, d_model=32, num_hidden_layers=3,
                                      vocab_size=VOCAB, ssm_cfg=dict(d_state=8))  # fmt: skip


def test_nanotrons_example_config_passes_mesh3d_config(capsys):
    from mesh3d.checks.__main__ import main

    main([str(EXAMPLE)])  # exits 2 on any problem
    out = capsys.readouterr().out
    assert "is_mamba_config: true" in out and "d_model: 1536" in out
    cfg = config_from_dict(copy.deepcopy(MAMBA))
    assert type(cfg.model.model_config) is MambaConfig
    assert spec_of(cfg.model.model_config).family == "mamba"


def _hf_model(seed: int = 0, **kw):
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                   state_size=8, conv_kernel=4, expand=2, use_mambapy=False,
                                   layer_norm_epsilon=1e-5, **kw)  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.MambaForCausalLM(cfg).float()
    with torch.no_grad():  # norms away from 1 so that a wrong norm shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return hf


def _ours_from(hf) -> torch.nn.Module:
    """Our model with `hf`'s weights, through the family's HFSpec."""
    spec = spec_of(MambaConfig())
    mc = spec.hf[0].config_from_hf(hf.config.to_dict(), "test")
    ours = spec.build(mc)
    state = spec.hf[0].weights_from_hf(dict(hf.state_dict()), mc)
    ours.load_state_dict({spec.hf[0].hf_to_ours(k): v for k, v in state.items()})
    return ours


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_and_adamw_steps_equal_transformers():
    """Same weights, same batches: logits and then four AdamW steps (loss and every weight)."""
    hf = _hf_model()
    ours = _ours_from(hf)
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf.eval()(ids).logits, ours.eval()(ids)
    assert _max_rel(got, expected) <= 1e-5, _max_rel(got, expected)
    hf.train(), ours.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
            for m in (hf, ours)]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        batch = torch.randint(0, VOCAB, (3, 21), generator=gen)
        losses = []
        for model, opt in zip((hf, ours), opts):
            out = model(batch[:, :-1])
            logits = out.logits if hasattr(out, "logits") else out
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), losses
    spec = spec_of(MambaConfig())
    mc = spec.hf[0].config_from_hf(hf.config.to_dict(), "test")
    back = spec.hf[0].weights_to_hf({spec.hf[0].ours_to_hf(k): v.detach()
                                     for k, v in ours.state_dict().items()}, mc)  # fmt: skip
    for name, p in hf.state_dict().items():
        assert _max_rel(back[name], p) <= 1e-4, name
    with torch.no_grad():
        assert _max_rel(ours.eval()(ids), hf.eval()(ids).logits) <= 1e-5


def test_hf_conversion_both_ways_through_nanotrons_layout(tmp_path):
    """from-hf writes Nanotron's layout at tp 2 x pp 2 (x/z rows interleaved in in_proj, the
    channel tensors split on dim 0); our model reads it and gives HF's logits; to-hf gives
    back HF's tensors exactly."""
    hf = _hf_model(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    convert.from_hf(tmp_path / "hf", tmp_path / "nt", tp=2, pp=2)
    d = json.loads((tmp_path / "nt" / "model_config.json").read_text())
    assert d["is_mamba_config"] is True and d["d_model"] == 32 and d["ssm_cfg"]["d_state"] == 8
    layer = tmp_path / "nt/model/model/decoder/0/pp_block/mixer"
    in_proj = load_file(layer / "in_proj/model_weight_pp-rank-0-of-2_tp-rank-1-of-2.safetensors")
    x, z = hf.state_dict()["backbone.layers.0.mixer.in_proj.weight"].chunk(2)
    assert torch.equal(in_proj["data"][0::2], x[32:]) and torch.equal(in_proj["data"][1::2], z[32:])
    mc = convert.read_model_config_json(tmp_path / "nt")
    ours = spec_of(mc).build(mc).eval()
    full = read_nanotron_weights(tmp_path / "nt" / "model", convert.shape_of(mc))
    ours.load_state_dict(full, strict=False)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf.eval()(ids).logits, ours(ids)[..., :VOCAB]
    assert _max_rel(got, expected) <= 1e-5
    convert.to_hf(tmp_path / "nt", tmp_path / "back")
    a, b = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(a) - {"lm_head.weight"} == set(b) - {"lm_head.weight"}
    assert all(torch.equal(a[k], b[k][: a[k].shape[0]]) for k in a if k in b)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    again = transformers.MambaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back["architectures"] == ["MambaForCausalLM"] and back["state_size"] == 8
    with torch.no_grad():
        assert _max_rel(again(ids).logits[..., :VOCAB], expected) <= 1e-6  # rows padded at tp 2


def test_init_follows_the_ssm_settings():
    mc = MambaConfig(d_model=32, num_hidden_layers=4, vocab_size=VOCAB,
                     ssm_cfg=MambaSSMConfig(d_state=8, dt_min=0.01, dt_max=0.05))  # fmt: skip
    spec = spec_of(mc)
    model = spec.build(mc)
    init_weights(model, 0.02, 4, "NUM_LAYERS", seed=5, init_std_fn=spec.init_for(mc))
    mixer = model.layers["1"].mixer
    assert torch.equal(mixer.A_log[7], torch.log(torch.arange(1.0, 9.0)))
    assert torch.equal(mixer.D, torch.ones(64))
    dt = F.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 0.01 * 0.999 and dt.max() <= 0.05 * 1.001 and dt.std() > 0
    assert mixer.dt_proj.weight.abs().max() <= 2**-0.5  # dt_rank ceil(32 / 16) = 2
    out_bound = 1 / math.sqrt(64) / math.sqrt(4)  # fan_in d_inner, rescaled by sqrt(layers)
    assert out_bound / 2 < mixer.out_proj.weight.abs().max() <= out_bound
    assert mixer.conv1d.weight.abs().max() <= 0.5  # 1 / sqrt(d_conv)
    assert abs(float(model.embed_tokens.weight.detach().std()) - 0.02) < 0.002
    assert not torch.equal(model.layers["0"].mixer.in_proj.weight, mixer.in_proj.weight)


def test_config_rejects_what_the_family_does_not_hold():
    from mesh3d.checks.validate import validate
    from mesh3d.errors import ConfigError

    for key, value, words in (("rms_norm", False, "rms_norm: false"),
                              ("ssm_cfg", {"dt_init": "xavier"}, "dt_init"),
                              ("ssm_cfg", {"dt_rank": "big"}, "dt_rank")):  # fmt: skip
        d = copy.deepcopy(MAMBA)
        d["model"]["model_config"][key] = value
        with pytest.raises(ConfigError, match=words):
            validate(config_from_dict(d), world_size=1)


@pytest.mark.skipif(
    not torch.cuda.is_available() or mamba_model.selective_scan_fn is None,
    reason="needs CUDA and mamba-ssm (its selective-scan kernel)",
)
def test_cuda_kernels_equal_the_plain_scan():
    mc = MambaConfig(d_model=64, num_hidden_layers=2, vocab_size=VOCAB)
    spec = spec_of(mc)
    model = spec.build(mc).cuda()
    init_weights(model, 0.02, 2, seed=1, init_std_fn=spec.init_for(mc))
    ids = torch.randint(0, VOCAB, (2, 64), device="cuda")
    fast = model(ids)
    for layer in model.layers.values():
        layer.mixer.fast_path = False
    plain = model(ids)
    assert _max_rel(fast, plain) <= 1e-4


def test_greedy_generation_equals_transformers():
    """`mesh3d.generation`'s greedy tokens (no KV cache for Mamba: the whole row each token)
    are transformers' `generate` (its recurrent state cache) from the same weights."""
    from mesh3d.generation.sampling import generate

    hf = _hf_model(seed=4).eval()
    ours = _ours_from(hf).eval()
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = generate(ours, prompt, 12, vocab_size=VOCAB)
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)  # fmt: skip
    assert got.tolist() == want.tolist()


def test_positions_restarting_inside_a_row_are_refused():
    mc = MambaConfig(d_model=32, num_hidden_layers=1, vocab_size=VOCAB)
    model = spec_of(mc).build(mc)
    ids = torch.zeros(2, 6, dtype=torch.long)
    plain = torch.arange(6).expand(2, 6)
    assert model(ids, positions=plain).shape == (2, 6, VOCAB)
    with pytest.raises(ValueError, match="cannot restart inside a row"):
        model(ids, positions=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))
