"""mesh3d as a library: the public names, a model of the user's own (not Llama) in 3D, a Hugging
Face `LlamaForCausalLM` under mesh3d's TP + DP, and `save_state` / `load_state` across layouts.

Only public names are used (`import mesh3d`), plus the worked example `recipes/custom_model.py`.

The tests of this subject that run in one process without a process group are in
`tests/unit/test_library_unit.py`.
The tests of this subject that launch real processes are in
`tests/launch/test_library_launch.py`."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from torch.distributed.tensor import DTensor

import mesh3d

REPO = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location(
        "custom_model", REPO / "recipes" / "custom_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters (collective over tp for DTensors)."""
    return {
        n: (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for n, p in model.named_parameters()
    }


def _merged(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor] | None:
    """Every stage's full weights, on global rank 0."""
    full = _full(model)
    if mesh["pp"].size() > 1:
        parts = [None] * mesh["pp"].size()
        dist.all_gather_object(parts, full, group=mesh["pp"].get_group())
        full = {k: v for part in parts for k, v in part.items()}
    return full if dist.get_rank() == 0 else None


def _custom(
    rank: int, world: int, dp: int, tp: int, pp: int, save: str | None, load_from: str | None
):
    ex = _example()
    out = ex.train(dp, tp, pp, steps=4, lr=1e-3)
    model, mesh = out["model"], out["mesh"]
    result = {"loss": out["loss"], "weights": _merged(model, mesh)}
    if save:
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        mesh3d.save_state(save, model, optimizer, mesh=mesh)
    if load_from:  # a fresh model of this layout, filled from a checkpoint of another layout
        torch.manual_seed(123)
        fresh = ex.GPT(ex.VOCAB, ex.DIM, ex.HEADS, ex.LAYERS, ex.SEQ)
        mesh3d.apply_tp(fresh, mesh["tp"], ex.TP_PLAN)
        mesh3d.load_state(load_from, fresh)
        result["loaded"] = _merged(fresh, mesh)
    return result


def _hf(rank: int, world: int, dp: int, tp: int, steps: int = 4) -> dict:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)  # the same full weights on every rank
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=dp, tp=tp, pp=1), "cpu")
    mesh3d.apply_tp(model, mesh["tp"], mesh3d.hf_llama_tp_plan())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    gbs, seq = 8, 16
    per_rank, dp_rank = gbs // dp, mesh["dp"].get_local_rank()
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 128, (gbs, seq + 1), generator=g)
        mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        logits = model(input_ids=mine[:, :-1]).logits
        loss = mesh3d.normalized_loss(logits, mine[:, 1:], 128, gbs * seq)
        loss.backward()
        mesh3d.allreduce_gradients(model, mesh["dp"].get_group())
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(float(total))
    return {"loss": losses, "weights": _merged(model, mesh)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, with max|b| floored at 1: biases start at zero, and 4 small steps
    leave them ~1e-3, where fp32 summation order alone is 1e-5 of their size."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    d = tmp_path_factory.mktemp("custom")
    three_d = run_ranks(8, _custom, 2, 2, 2, str(d / "ckpt"), None, timeout=300)[0]
    one, = run_ranks(1, _custom, 1, 1, 1, None, str(d / "ckpt"), timeout=200)  # fmt: skip
    four = run_ranks(4, _custom, 1, 2, 2, None, str(d / "ckpt"), timeout=200)[0]
    return {"3d": three_d, "one": one, "four": four}


def test_custom_model_3d_equals_one_process(custom):
    ref, got = custom["one"], custom["3d"]
    assert _rel(torch.tensor(got["loss"]), torch.tensor(ref["loss"])) <= 1e-5
    assert ref["loss"][-1] < ref["loss"][0]  # it learns
    assert got["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():
        assert _rel(got["weights"][name], w) <= 1e-5, name


def test_save_state_at_2x2x2_loads_at_other_layouts(custom):
    saved = custom["3d"]["weights"]
    for layout in ("one", "four"):
        loaded = custom[layout]["loaded"]
        assert loaded.keys() == saved.keys(), layout
        for name, w in saved.items():
            assert torch.equal(loaded[name], w), (layout, name)


def _warnings_of_the_example(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _example().train(1, 1, 2, steps=2, lr=1e-3)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_the_pipelined_example_warns_nothing():
    """Issue 26 item 12: the 8-rank example printed torch's "Converting a tensor with
    requires_grad=True to a scalar" once per last-stage rank (4x): `run_schedule`'s losses
    still carried their graph after the backward. They come back detached."""
    for rank, caught in enumerate(run_ranks(2, _warnings_of_the_example, timeout=200)):
        assert caught == [], (rank, caught)


def test_hf_llama_under_mesh3d_tp_and_dp():
    pytest.importorskip(
        "transformers", reason="transformers is not installed (the dev extra has it)"
    )
    ref = run_ranks(1, _hf, 1, 1, timeout=200)[0]
    got = run_ranks(4, _hf, 2, 2, timeout=300)[0]
    assert _rel(torch.tensor(got["loss"]), torch.tensor(ref["loss"])) <= 1e-5
    for name, w in ref["weights"].items():
        assert _rel(got["weights"][name], w) <= 1e-5, name
