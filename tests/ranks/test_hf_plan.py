"""`mesh3d plan --hf-model`: the memory of a `transformers` model read off its module tree
(`mesh3d/plan/hf.py`), against the model itself: parameter bytes at 1x1x1 exactly, the
activations measured on meta equal to what a real CPU forward saves (same causal mask, SDPA's
math path), shards at tp 2 x pp 2
covering the model, MoE's unmeasured activations said in a note, and the command line."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

transformers = pytest.importorskip("transformers", reason="the HF plan needs transformers")

from mesh3d.plan.hf import format_hf_plan  # noqa: E402
from mesh3d.plan.hf import plan_hf as plan_here  # noqa: E402


def plan_hf(model, **kw):
    """`plan_hf` in a forked child: its fake process groups (and the meshes torch keeps of them)
    stay out of this process, whose later tests fork real ranks."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        torch.set_num_threads(1)  # a forked child using the parent's thread pool hangs
        try:
            queue.put(("ok", plan_here(model, **kw)))
        except BaseException as e:  # noqa: BLE001 - handed to the parent
            queue.put(("err", repr(e)))

    proc = ctx.Process(target=child)
    proc.start()
    status, value = queue.get(timeout=120)
    proc.join(10)
    assert status == "ok", value
    return value


SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_hidden_layers=4, max_position_embeddings=64)  # fmt: skip


def _neox():
    config = transformers.GPTNeoXConfig(**SMALL, rotary_pct=0.5, tie_word_embeddings=False)
    return transformers.GPTNeoXForCausalLM(config)


def _saved_bytes(model, tokens) -> int:
    """Bytes autograd saves in a real forward (distinct tensors) + the loss's fp32 logits."""
    seen = {}

    def pack(t):
        seen[id(t)] = t.numel() * t.element_size()
        return t

    b, n = tokens.shape
    mask = torch.ones(b, 1, n, n, dtype=torch.bool).tril()  # the plan's explicit causal mask
    # SDPA's math path, which meta takes: it saves the attention probabilities
    with sdpa_kernel(SDPBackend.MATH), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    return sum(seen.values()) + logits.numel() * 4


def test_one_process_plan_equals_the_model():
    model = _neox()
    plan = plan_hf(model, micro_batch=2, sequence_length=32)
    (stage,) = plan.stages
    n = sum(p.numel() for p in model.parameters())
    assert plan.total_params == n and stage.params == n
    assert stage.param_bytes == stage.grad_bytes == 4 * n
    assert stage.optimizer_bytes == 8 * n + 4 * len(list(model.parameters()))
    real = _saved_bytes(model, torch.randint(0, 128, (2, 32)))
    assert stage.activation_bytes == real  # meta counts what a real forward saves
    assert (
        stage.peak_bytes == 2 * stage.param_bytes + stage.optimizer_bytes + stage.activation_bytes
    )


def test_tp2_pp2_shards_cover_the_model():
    model = _neox()
    n = sum(p.numel() for p in model.parameters())
    plan = plan_hf(model, tp=2, pp=2, micro_batch=1, sequence_length=32, microbatches=4)
    assert [i for s in plan.stages for i in s.layers] == list(range(4))  # each layer once
    held = sum(s.params for s in plan.stages)  # one tp rank: projections halved, norms whole
    whole = ("norm", "attention.dense.bias", "dense_4h_to_h.bias")  # and row-parallel biases
    kept = sum(p.numel() for name, p in model.named_parameters() if any(w in name for w in whole))
    assert held * 2 - kept == n  # two tp ranks hold it all, the replicated ones on both
    assert [s.in_flight for s in plan.stages] == [2, 1]  # 1F1B's warm-up on the first stage
    one = plan_hf(model, micro_batch=1, sequence_length=32).stages[0]
    assert all(s.activation_bytes < one.activation_bytes for s in plan.stages)
    zero1 = plan_hf(model, dp=2, tp=2, pp=2, dp_mode="zero1", sequence_length=32)
    assert all(z.params < s.params for z, s in zip(zero1.stages, plan.stages))  # FSDP shards


def test_moe_activations_unmeasured_are_said():
    config = transformers.MixtralConfig(**{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=2,
                                        num_local_experts=4)  # fmt: skip
    plan = plan_hf(transformers.MixtralForCausalLM(config), sequence_length=32)
    stage = plan.stages[0]
    if stage.activation_bytes is None:  # data-dependent routing cannot run on meta
        assert plan.note.startswith("activations not measured")
        assert "leaves them out" in format_hf_plan(plan)
    assert stage.params == sum(
        p.numel() for p in transformers.MixtralForCausalLM(config).parameters()
    )


def test_command_line(tmp_path):
    _neox().save_pretrained(tmp_path / "neox")
    cmd = [sys.executable, "-m", "mesh3d.plan", "--hf-model", str(tmp_path / "neox"),
           "parallelism.tp=2", "parallelism.pp=2", "tokens.sequence_length=32"]  # fmt: skip
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "GPTNeoXForCausalLM: 150,400 parameters; dp 1 x tp 2 x pp 2" in ok.stdout
    assert ok.stdout.count("\n| ") == 3  # the header and two stages
    bad = subprocess.run([*cmd[:4], str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "error: model:" in bad.stderr
    assert "Traceback" not in bad.stderr
