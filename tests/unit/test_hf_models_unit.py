"""`mesh3d.hf_models` without a process group: each architecture's own TP plan translated to
torch's styles, and the one-line refusals (sizes tp does not divide, styles mesh3d cannot apply).
The multi-rank parity tests are in `tests/ranks/test_hf_models.py`."""

from __future__ import annotations

import pytest
import torch
from test_hf_models import tiny
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import mesh3d
from mesh3d.hf_models import decoder_layers, hf_tp_plan, load_hf

pytest.importorskip("transformers", reason="transformers is not installed (the dev extra has it)")


def test_gpt_neox_plan_is_its_own_in_torch_styles():
    plan = hf_tp_plan(tiny("gpt_neox"), 2)
    assert set(plan) == {"lm_head", "gpt_neox.embed_in", "gpt_neox.layers.*.attention.query_key_value",
                         "gpt_neox.layers.*.attention.dense", "gpt_neox.layers.*.mlp.dense_h_to_4h",
                         "gpt_neox.layers.*.mlp.dense_4h_to_h"}  # fmt: skip
    assert type(plan["gpt_neox.layers.*.attention.query_key_value"]) is ColwiseParallel
    assert type(plan["gpt_neox.layers.*.mlp.dense_4h_to_h"]) is RowwiseParallel
    head = plan["lm_head"]  # vocab-parallel: the logits stay sharded on the vocabulary
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    gathered = hf_tp_plan(tiny("gpt_neox"), 2, vocab_parallel=False)["lm_head"]
    assert gathered.output_layouts == (Replicate(),)  # transformers' colwise_gather_output


def test_mixtral_plan_splits_attention_only():
    plan = hf_tp_plan(tiny("mixtral"), 2)
    assert not any("mlp" in k or "experts" in k for k in plan)
    assert "model.layers.*.self_attn.o_proj" in plan


def test_tp_that_does_not_divide_the_heads_is_refused_in_one_line():
    model = tiny("gpt_neox", num_attention_heads=6, hidden_size=96)  # 96 features, 6 heads
    with pytest.raises(mesh3d.UserError) as caught:
        hf_tp_plan(model, 4)
    msg = str(caught.value)
    assert msg.startswith(
        "tp: num_attention_heads=6 of GPTNeoXForCausalLM is not divisible by tp=4"
    )
    assert "query_key_value" in msg and "\n" not in msg


def test_tp_that_does_not_divide_the_vocabulary_is_refused_with_the_fix():
    with pytest.raises(
        mesh3d.UserError, match=r"tp: .* 127 vocabulary size, not divisible by tp=2; pad"
    ):
        hf_tp_plan(tiny("mixtral", vocab_size=127), 2)


def test_a_style_mesh3d_cannot_apply_is_refused_naming_module_and_style():
    names = {"model.layers.*.mlp.experts": "moe_tp_experts"}
    with pytest.raises(mesh3d.UserError) as caught:
        hf_tp_plan(tiny("mixtral"), 2, names=names)
    msg = str(caught.value)
    assert "'model.layers.*.mlp.experts'" in msg and "'moe_tp_experts'" in msg
    assert msg.startswith("tp: ") and "use tp=1" in msg


def test_decoder_layers_come_from_the_pipeline_plan():
    assert decoder_layers(tiny("gpt_neox")) == "gpt_neox.layers"
    assert decoder_layers(tiny("gemma2")) == "model.layers"


@pytest.mark.parametrize(
    "arch,extra",
    [("gpt_neox", {}), ("gemma2", {"tie_word_embeddings": False}), ("mixtral", {})],
)
def test_stages_chained_give_the_models_logits_and_keep_its_names(arch, extra):
    """Gemma 2 alternates sliding and full attention by layer: each stage reads its own layers'
    types, so 3 stages of 4 layers (sliding window 4 < 12 tokens) must still match."""
    torch.manual_seed(0)
    model = tiny(arch, num_hidden_layers=4, sliding_window=4, **extra) if arch == "gemma2" else (
        tiny(arch, num_hidden_layers=4, **extra))  # fmt: skip
    cuts = [[0], [1, 2], [3]]
    stages = [mesh3d.build_hf_stage(model, i, 3, layers) for i, layers in enumerate(cuts)]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.allclose(x, model(input_ids=ids).logits, atol=1e-6, rtol=0)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once


def test_tied_embeddings_across_stages_become_two_equal_copies():
    model = tiny("gemma2")  # ties its embedding and head
    first, last = (mesh3d.build_hf_stage(model, i, 2, [i]) for i in (0, 1))
    emb, no_head = first.mesh3d_tied_ends()
    no_emb, head = last.mesh3d_tied_ends()
    assert no_head is None and no_emb is None
    assert head.weight is not emb.weight and torch.equal(head.weight, emb.weight)
    assert last.tied_parameters == {"lm_head.weight": "model.embed_tokens.weight"}
    assert mesh3d.build_hf_stage(model, 0, 1, [0, 1]).mesh3d_tied_ends() is None  # one stage


def test_stage_layers_out_of_range_are_refused():
    with pytest.raises(mesh3d.UserError, match=r"pp: stage 1 layers \[1, 5\] must be increasing"):
        mesh3d.build_hf_stage(tiny("gpt_neox"), 1, 2, [1, 5])


def test_a_stage_may_hold_no_layers():
    torch.manual_seed(0)
    model = tiny("gpt_neox")
    stages = [mesh3d.build_hf_stage(model, i, 2, layers) for i, layers in enumerate([[0, 1], []])]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(stages[1](stages[0](ids)), model(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_a_saved_folder_loads_as_the_model(tmp_path):
    torch.manual_seed(0)
    model = tiny("mixtral")
    model.save_pretrained(tmp_path / "mixtral")
    loaded = load_hf(str(tmp_path / "mixtral"))
    assert type(loaded) is type(model)
    want = dict(model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in loaded.named_parameters())
    assert load_hf(model) is model


def test_a_folder_without_a_model_is_one_line(tmp_path):
    with pytest.raises(mesh3d.UserError) as caught:
        load_hf(tmp_path)
    msg = str(caught.value)
    assert msg.startswith(f"model: '{tmp_path}' is neither a folder") and "\n" not in msg
    assert msg.endswith("(it has no config.json)"), msg


def _sp_plan(model, layers: str, final: list[str]):
    from mesh3d.hf_sequence import sequence_parallel_plan

    return sequence_parallel_plan(model, hf_tp_plan(model, 2), layers, final)


def test_sequence_parallel_plan_shards_norms_and_gathers_blocks():
    from torch.distributed.tensor.parallel import SequenceParallel

    from mesh3d.hf_sequence import _FullInput

    plan = _sp_plan(tiny("mixtral"), "model.layers", ["model.norm"])
    assert isinstance(plan["model.layers.*.input_layernorm"], SequenceParallel)
    assert isinstance(plan["model.norm"], SequenceParallel)
    attn, moe = plan["model.layers.*.self_attn"], plan["model.layers.*.mlp"]
    assert not attn.keep_rows and moe.keep_rows  # the replicated MoE block keeps its rows
    assert isinstance(attn, _FullInput)
    assert plan["model.layers.*.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert plan["model.embed_tokens"].output_layouts == (Shard(1),)


def test_sequence_parallel_refuses_dropout_on_sequence_shards():
    model = tiny("gpt_neox", hidden_dropout=0.1)
    with pytest.raises(mesh3d.UserError, match=r"^tp: GPTNeoXForCausalLM's post_attention_dropout"):
        _sp_plan(model, "gpt_neox.layers", ["gpt_neox.final_layer_norm"])
