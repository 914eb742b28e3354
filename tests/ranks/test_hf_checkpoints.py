"""Checkpoints of `transformers` models trained through mesh3d (`parallelize_hf`, `build_hf_stage`):
saved at dp2 x tp2 x pp2 with `mesh3d.save_state`, resumed with `mesh3d.load_state` at 1x1x1 and
at dp2 x tp2 x pp1, the resumed runs continue exactly as the saving run did (losses and final
weights within 1e-5; optimizer state and step counters restored), and `mesh3d.export_hf` turns
the checkpoint into a folder `from_pretrained` loads with the same logits.

GPT-NeoX (fused query_key_value, LayerNorm with biases, partial rotary) under ZeRO-1 at 2x2x2,
and Mixtral (MoE) with DP by all-reduce, so both DP forms are saved."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from test_hf_models import GBS, SEQ, SMALL, VOCAB, _batch, _full, tiny

import mesh3d
from mesh3d.convert import main
from mesh3d.parallel.pipeline import pipeline_stage

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the dev extra has it)"
)

SAVE_AT, STEPS = 2, 4  # train 2 steps, save, train 2 more


def _trainer(arch: str, dp: int, tp: int, pp: int, dp_mode: str, seed: int):
    """This rank's parts of `arch` at dp x tp x pp (one decoder layer a stage), its optimizer
    and a function training one step (returns the global loss)."""
    torch.manual_seed(seed)
    model = tiny(arch)
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=dp, tp=tp, pp=pp), "cpu")
    pp_rank = mesh["pp"].get_local_rank()
    parts = [mesh3d.build_hf_stage(model, pp_rank, pp, [pp_rank])] if pp > 1 else [model]
    for part in parts:
        mesh3d.parallelize_hf(part, mesh, dp_mode=dp_mode)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, eps=1e-6, foreach=False)
    dp_group, dp_rank, per = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), GBS // dp
    scale = dp if dp_mode != "replicate" else 1  # FSDP averages gradients over dp

    def loss_fn(logits, labels):
        return mesh3d.normalized_loss(logits, labels, VOCAB, GBS * SEQ) * scale

    schedule = stages = None
    if pp > 1:
        stages = [pipeline_stage(parts[0], pp_rank, pp, torch.device("cpu"), mesh["pp"].get_group(),
                                 microbatch_size=per // 2, seq_len=SEQ, seq_len_local=SEQ,
                                 hidden_size=SMALL["hidden_size"], vocab_size=VOCAB,
                                 dtype=torch.float32)]  # fmt: skip
        schedule = mesh3d.build_schedule("1f1b", stages, 2, loss_fn)

    def step(i: int) -> float:
        mine = _batch(i)[dp_rank * per : (dp_rank + 1) * per]
        if pp > 1:
            losses = mesh3d.run_schedule(schedule, stages, mine[:, :-1], mine[:, 1:])
            total = (sum(losses) / scale) if losses else torch.zeros(())
        else:
            loss = loss_fn(parts[0](input_ids=mine[:, :-1]).logits, mine[:, 1:])
            loss.backward()
            total = loss.detach() / scale
        if dp_mode == "replicate":
            for part in parts:
                mesh3d.allreduce_gradients(part, dp_group)
        optimizer.step()
        optimizer.zero_grad()
        for group in (mesh["pp"].get_group(), dp_group):
            dist.all_reduce(total, group=group)
        return float(total)

    return parts, optimizer, mesh, step


def _weights(parts, mesh) -> dict:
    mine = {n: _full(p) for part in parts for n, p in part.named_parameters()}
    gathered = [None] * mesh["pp"].size()
    dist.all_gather_object(gathered, mine, group=mesh["pp"].get_group())
    return {k: v for got in gathered for k, v in got.items()}


def _save_and_go_on(rank, world, arch, dp_mode, path):
    parts, optimizer, mesh, step = _trainer(arch, 2, 2, 2, dp_mode, seed=0)
    for i in range(SAVE_AT):
        step(i)
    mesh3d.save_state(path, parts, optimizer, mesh=mesh)
    losses = [step(i) for i in range(SAVE_AT, STEPS)]
    return {"loss": losses, "weights": _weights(parts, mesh)}


def _resume(rank, world, arch, dims, dp_mode, path):
    parts, optimizer, mesh, step = _trainer(arch, *dims, dp_mode, seed=1)  # other weights
    mesh3d.load_state(path, parts, optimizer)
    counters = {float(s["step"]) for s in optimizer.state.values()}
    losses = [step(i) for i in range(SAVE_AT, STEPS)]
    return {"loss": losses, "weights": _weights(parts, mesh), "steps": counters}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("arch,dp_mode", [("gpt_neox", "zero1"), ("mixtral", "replicate")])
def test_saved_at_2x2x2_resumes_exactly_elsewhere_and_exports(arch, dp_mode, tmp_path):
    path = tmp_path / "ckpt"
    saved = run_ranks(8, _save_and_go_on, arch, dp_mode, str(path), timeout=120)[0]
    for dims in [(1, 1, 1), (2, 2, 1)]:
        world = dims[0] * dims[1] * dims[2]
        got = run_ranks(world, _resume, arch, dims, "replicate", str(path), timeout=90)[0]
        assert got["steps"] == {float(SAVE_AT)}, dims  # AdamW's step counters came back
        assert max(abs(a - b) for a, b in zip(got["loss"], saved["loss"])) <= 1e-5, dims
        assert got["weights"].keys() == saved["weights"].keys()
        assert _max_diff(got["weights"], saved["weights"]) <= 1e-5, dims

    out = mesh3d.export_hf(path, tiny(arch), tmp_path / "exported")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(5)
    reference = tiny(arch)
    mesh3d.load_state(path, reference)  # the checkpoint's weights, read into the same class
    tokens = _batch(9)[:, :-1]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, reference(input_ids=tokens).logits)
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    with pytest.raises(mesh3d.UserError, match="exists"):
        mesh3d.export_hf(path, tiny(arch), out)
    tiny(arch).save_pretrained(tmp_path / "original")  # the command line: the original folder
    main(["to-hf", "--checkpoint", str(path), "--model", str(tmp_path / "original"),
          "--output", str(tmp_path / "cli")])  # fmt: skip
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, reference(input_ids=tokens).logits)
