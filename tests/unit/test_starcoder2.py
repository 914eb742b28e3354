"""Starcoder2 (Nanotron's Starcoder2Config): multi-query and grouped-query attention, sliding
windows with global layers, LayerNorm and GELU with biases, tied embeddings, and dropout whose
masks are the same at every layout: with dropout 0.1, dp2 x tp2 x pp2 (sequence parallel,
ZeRO-1, recomputed layers) and cp2 x tp2 x pp2 train like one process; Nanotron's checkpoint
names; a checkpoint saved at dp2 x tp2 x pp2 resumes in one process.

The tests of this subject that need a process group are in
`tests/ranks/test_starcoder2_ranks.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from nanotron_keys import config_key_problems
from parity import TINY, VOCAB, layout_overrides

from mesh3d.checkpoint.nanotron_weights import (
    nanotron_params,
    read_nanotron_weights,
    write_nanotron_weights,
)
from mesh3d.config import Starcoder2Config, apply_overrides, config_from_dict
from mesh3d.config.load import nanotron_config_dict
from mesh3d.models.dropout import KeyedDropout, token_keys
from mesh3d.models.registry import shape_of, spec_of
from mesh3d.parallel.context import local_indices
from mesh3d.plan import make_plan

STAR = copy.deepcopy(TINY)
STAR["model"]["model_config"] = dict(
    is_starcoder2_config=True,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_hidden_layers=4,
    max_position_embeddings=16,
    vocab_size=VOCAB,
    attn_pdrop=0.1,
    embd_pdrop=0.1,
    resid_pdrop=0.1,
)  # fmt: skip  (multi-query: Nanotron's default)


def test_every_field_of_nanotrons_config_parses_and_is_written_back():
    """Nanotron's Starcoder2Config keys (its defaults, then the test model's) load as
    Starcoder2, and a checkpoint's config.yaml passes Nanotron's strict parser."""
    cfg = config_from_dict(copy.deepcopy(STAR))
    mc = cfg.model.model_config
    assert type(mc) is Starcoder2Config and spec_of(mc).family == "starcoder2"
    written = nanotron_config_dict(cfg, step=1, consumed=8)
    assert config_key_problems(written) == []
    assert type(written["model"]["model_config"]["rope_theta"]) is int  # Nanotron's type
    everything = copy.deepcopy(STAR)
    everything["model"]["model_config"] = {k: getattr(Starcoder2Config(), k) for k in
                                           Starcoder2Config.__dataclass_fields__}  # fmt: skip
    assert config_from_dict(everything).model.model_config == Starcoder2Config()


# ---- dropout masks: a function of each value's identity ---------------------------------------


def test_dropout_masks_are_the_one_process_masks_on_any_shard():
    """A mask drawn on a dp slice of the samples, a cp rank's tokens, a tp rank's sequence shard
    or its heads is that slice of the whole mask; the same keys give the same mask (recompute),
    another step another one; kept values are scaled by 1 / (1 - p)."""
    p, samples, seq = 0.25, torch.arange(4), torch.arange(16)
    keys = token_keys(7, 3, samples, seq)  # (4 samples, 16 positions)
    drop = KeyedDropout(p, site=5).train()
    x = torch.ones(4, 16, 32)
    full = drop(x, keys)
    assert set(full.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p)).item()}
    assert abs(float((full == 0).float().mean()) - p) < 0.04
    assert torch.equal(drop(x, keys), full)  # recomputed in backward: the same mask
    assert not torch.equal(drop(x, token_keys(7, 4, samples, seq)), full)  # the next step
    assert torch.equal(drop(x[2:], token_keys(7, 3, samples[2:], seq)), full[2:])  # dp rank 1
    for r in range(2):  # cp 2: rank r holds chunks r and 3 - r of each sample
        where = local_indices(16, 2, r)
        local = drop(x[:, where], token_keys(7, 3, samples, where))
        assert torch.equal(local, full[:, where])
        drop.tp_rank = r  # sequence parallel over tp 2: rank r holds tokens 8r..8r+7
        assert torch.equal(drop(x[:, 8 * r : 8 * r + 8], keys), full[:, 8 * r : 8 * r + 8])
    probs = torch.ones(4, 8, 16, 16)
    drop.tp_rank = 0
    whole = drop.attention(probs, keys)
    assert abs(float((whole == 0).float().mean()) - p) < 0.02
    drop.tp_rank = 1  # tp 2: heads 4..7
    assert torch.equal(drop.attention(probs[:, 4:], keys), whole[:, 4:])
    assert torch.equal(drop.eval()(x, keys), x)  # no dropout in eval


def test_every_dropout_site_acts_in_training_only():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    keys = token_keys(1, 1, torch.arange(2), torch.arange(12))
    for site in ("attn_pdrop", "embd_pdrop", "resid_pdrop"):
        mc = Starcoder2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_hidden_layers=2, vocab_size=64, attn_pdrop=0.0,
                              embd_pdrop=0.0, resid_pdrop=0.0)  # fmt: skip
        setattr(mc, site, 0.2)
        model = spec_of(mc).build(mc, attention="sdpa")
        with torch.no_grad():
            trained = model(ids, token_keys=keys)
            assert torch.equal(model(ids, token_keys=keys), trained), site
            plain = model.eval()(ids, token_keys=keys)
        assert float((trained - plain).abs().max()) > 1e-3, site


# ---- Nanotron's names -------------------------------------------------------------------------

LAYER = "model.decoder.0.pp_block."
# from Nanotron's src/nanotron/models/starcoder2.py (GPTBlock: ln_1, attn, ln_2, ff), module order
NORMS_MLP = ["ln_2.weight", "ln_2.bias", "ff.c_fc.weight", "ff.c_fc.bias", "ff.c_proj.weight",
             "ff.c_proj.bias"]  # fmt: skip
# multi-query: q and kv are `nn.ParameterDict`s built from plain dicts (torch sorts: bias first)
MQA_NAMES = ["ln_1.weight", "ln_1.bias", "attn.qkv.q.bias", "attn.qkv.q.weight",
             "attn.qkv.kv.bias", "attn.qkv.kv.weight", "attn.o.weight", "attn.o.bias",
             *NORMS_MLP]  # fmt: skip
GQA_NAMES = ["ln_1.weight", "ln_1.bias", "attn.query_key_value.weight",
             "attn.query_key_value.bias", "attn.dense.weight", "attn.dense.bias", *NORMS_MLP]  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True], ids=["multi-query", "grouped-query"])
def test_nanotron_names_files_and_round_trip(tmp_path, grouped):
    mc = Starcoder2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_hidden_layers=2, vocab_size=64, grouped_query=grouped,
                          num_kv_heads=2 if grouped else None)  # fmt: skip
    shape = shape_of(mc, 64)
    params = nanotron_params(shape, pp=2)
    layer = GQA_NAMES if grouped else MQA_NAMES
    assert [p.name for p in params] == [
        "model.token_embeddings.pp_block.token_embedding.weight",
        *(LAYER + n for n in layer),
        *(LAYER.replace(".0.", ".1.") + n for n in layer),
        "model.final_layer_norm.pp_block.weight",
        "model.final_layer_norm.pp_block.bias",
    ]  # fmt: skip  (the tied lm_head is never written)
    torch.manual_seed(0)
    model = spec_of(mc).build(mc, attention="sdpa")
    full = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    paths = {p.relative_to(tmp_path).as_posix() for p in
             write_nanotron_weights(tmp_path, full, shape, tp=2, pp=2)}  # fmt: skip
    attn = "model/decoder/0/pp_block/attn/"
    sharded = "_pp-rank-0-of-2_tp-rank-1-of-2.safetensors"
    if grouped:  # whole key/value groups per tp rank; the row-parallel bias written once
        assert {
            attn + "query_key_value/model_bias" + sharded,
            attn + "dense/model_bias.safetensors",
        } <= paths
    else:  # the key/value head written once, as Nanotron's tied copies
        assert {
            attn + "qkv/q/model_weight" + sharded,
            attn + "qkv/kv/model_weight.safetensors",
        } <= paths
    assert "model/final_layer_norm/pp_block/model_bias.safetensors" in paths
    back = read_nanotron_weights(tmp_path, shape)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


def test_plan_counts_exact_parameters_and_says_activations_are_estimated():
    """`mesh3d plan` at dp2 x tp2 x pp2: each rank's parameters are those training holds (the
    multi-query k/v head whole on both tp ranks, the row-parallel biases replicated); its
    activation bytes come from Llama's table, and the plan says so."""
    layout = layout_overrides(2, 2, "REDUCE_SCATTER", 0, None) + ["parallelism.pp=2"]
    plan = make_plan(apply_overrides(config_from_dict(copy.deepcopy(STAR)), layout), 8)
    shape = shape_of(config_from_dict(copy.deepcopy(STAR)).model.model_config, VOCAB)
    h, f, dh = 64, 128, 8
    per_layer = (
        4 * h
        + h * h // 2
        + h // 2
        + 2 * dh * h
        + 2 * dh
        + h * h // 2
        + h
        + f // 2 * h
        + f // 2
        + f // 2 * h
        + h
    )  # fmt: skip  (tp rank's share)
    embed = shape.padded_vocab // 2 * h
    first, last = (len(stage.layers) for stage in plan.stages)  # Nanotron's cost split: 3, 1
    assert [plan.ranks[r].param_elements for r in (0, 7)] == [
        embed + first * per_layer,
        last * per_layer + 2 * h + embed,
    ]  # fmt: skip  (tied head copy)
    assert any("starcoder2's layers are counted with Llama's table" in n for n in plan.notes)


# ---- layouts ----------------------------------------------------------------------------------
