"""`python -m mesh3d.convert` for Qwen2 and Qwen3 with a `moe_config`, as Hugging Face's
`Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM` (no shared expert, `norm_topk_prob` on and off),
both ways: mesh3d's logits equal transformers' on the converted weights, HF -> mesh3d -> HF is
bitwise, both on-disk expert forms are read (per expert, what `save_pretrained` writes and the
Hub holds; stacked, transformers 5's in-memory form), and a mesh3d-trained MoE checkpoint
converts. What HF's MoE models cannot express is refused.

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_convert_moe.py`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dist import run_ranks
from parity import TINY, layout_overrides, train_runs
from test_convert_moe import IDS, VOCAB, mesh3d_logits, rel_err, transformers

from mesh3d.checkpoint import hf as convert


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_mesh3d_trained_moe_checkpoint_converts(tmp_path, family):
    """A few steps of mesh3d training (pp 2, MoE on layers 0 and 2, no q/k/v bias; Qwen2 with a
    shared expert, Qwen3 without and with `mesh3d.norm_topk_prob`), then to-hf: transformers
    loads it and its logits equal mesh3d's."""
    moe = copy.deepcopy(TINY)
    mc = moe["model"]["model_config"]
    mc.pop("is_llama_config")
    qwen2 = family == "qwen2"
    mc.update(is_qwen2_config=True, num_hidden_layers=3, vocab_size=VOCAB,
              moe_config=dict(num_experts=4, top_k=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, enable_shared_expert=qwen2,
                              router_aux_loss_coef=0.1, layers=[0, 2]))  # fmt: skip
    if not qwen2:
        moe["mesh3d"].update(model_family="qwen3", head_dim=16, norm_topk_prob=True)
    ckpt = tmp_path / "ckpt"
    overrides = layout_overrides(1, 1, "ALL_REDUCE", 0, False) + [
        "parallelism.pp=2", "tokens.train_steps=3",
        f"checkpoints.checkpoints_path={ckpt}", "checkpoints.checkpoint_interval=3",
    ]  # fmt: skip
    run_ranks(2, train_runs, [overrides], moe, timeout=300)
    convert.to_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is not qwen2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("Qwen2MoeForCausalLM" if qwen2 else "Qwen3MoeForCausalLM")
    step = convert.weights_dir(ckpt, "--checkpoint")
    with torch.no_grad():
        expected = hf(IDS).logits[..., :VOCAB]
    err = rel_err(mesh3d_logits(step), expected)
    print(f"trained {family} checkpoint: max relative logit error {err:.2e}")
    assert err <= 1e-5
