"""`mesh3d.parallelize_hf`: three `transformers` causal LMs that differ in structure, each under
its own TP plan and mesh3d's DP at dp 2 x tp 2, against the unmodified model trained by a plain
one-process loop on the same batches (torch's cross-entropy, no mesh3d): losses, gradient norms
and final weights within 1e-5.

- GPT-NeoX: LayerNorm with biases, GELU, partial rotary (rotary_pct 0.5), parallel residual,
  fused query_key_value (heads interleaved q, k, v), a vocab-parallel `embed_in`;
- Gemma 2: four RMSNorms per layer, GeGLU, grouped-query attention, logit soft-capping, tied
  embedding and head (both vocab-parallel, one parameter);
- Mixtral: a mixture of experts; its plan splits attention only, the router and experts stay
  replicated.

Each also with sequence parallelism (`sequence_parallel=True`), under each DP mode once.

Pipelined, one decoder layer a stage, against the same plain loop: 1F1B (GPT-NeoX at 1x1x2 and
2x2x2 with ZeRO-1, Mixtral at 2x2x2), Interleaved 1F1B (GPT-NeoX at 1x1x2, Gemma 2 at 2x2x2 full
shard; 2 stages a rank) and ZBV zero bubble (Gemma 2 at dp1 x tp2 x pp2; V placement).

The tests of this subject that run in one process without a process group are in
`tests/unit/test_hf_models_unit.py`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from torch.distributed.tensor import DTensor

import mesh3d

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the dev extra has it)"
)  # imported before the ranks fork: they find it loaded

VOCAB, GBS, SEQ, STEPS = 128, 8, 16, 4
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_hidden_layers=2, max_position_embeddings=32)  # fmt: skip


def tiny(arch: str, **extra):
    """A tiny random `transformers` model of `arch` (`extra` overrides config values), the same
    weights for the same seed."""
    t = transformers
    if arch == "gpt_neox":
        kw = dict(rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False)
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**{**SMALL, **kw, **extra}))
    if arch == "gemma2":  # eager attention: SDPA has no logit soft-capping
        kw = dict(num_key_value_heads=2, head_dim=16, attn_implementation="eager")
        return t.Gemma2ForCausalLM(t.Gemma2Config(**{**SMALL, **kw, **extra}))
    kw = dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return t.MixtralForCausalLM(t.MixtralConfig(**{**SMALL, **kw, **extra}))


def _batch(step: int) -> torch.Tensor:
    """[GBS, SEQ + 1] rows counting up from a random start (mod VOCAB): learnable in a few steps."""
    start = torch.randint(0, VOCAB, (GBS, 1), generator=torch.Generator().manual_seed(step))
    return (start + torch.arange(SEQ + 1)) % VOCAB


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _grad_norm(model) -> float:
    return float(torch.sqrt(sum(_full(p.grad).double().square().sum() for p in model.parameters())))


def _plain(rank: int, world: int, arch: str, **extra) -> dict:
    """The unmodified model, one process, a plain loop: the reference."""
    torch.manual_seed(0)
    model = tiny(arch, **extra)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    out = {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        tokens = _batch(step)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        out["grad_norm"].append(_grad_norm(model))
        optimizer.step()
        optimizer.zero_grad()
        out["loss"].append(float(loss))
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _mesh3d(
    rank: int, world: int, arch: str, dp: int, tp: int, dp_mode: str, sp: bool = False
) -> dict:
    torch.manual_seed(0)
    model = tiny(arch)  # the same full weights on every rank
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=dp, tp=tp, pp=1), "cpu")
    mesh3d.parallelize_hf(model, mesh, dp_mode=dp_mode, sequence_parallel=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, foreach=False)
    dp_group, dp_rank, per = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), GBS // dp
    scale = dp if dp_mode != "replicate" else 1  # FSDP averages gradients over dp
    out = {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        mine = _batch(step)[dp_rank * per : (dp_rank + 1) * per]
        logits = model(input_ids=mine[:, :-1]).logits
        loss = mesh3d.normalized_loss(logits, mine[:, 1:], VOCAB, GBS * SEQ)
        (loss * scale).backward()
        if dp_mode == "replicate":
            mesh3d.allreduce_gradients(model, dp_group)
        # mesh3d's norm over mixed parameters (sharded projections, replicated norms)
        out["grad_norm"].append(mesh3d.clip_grad_norm(list(model.parameters()), None))
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        out["loss"].append(float(total))
    out["vocab_sharded_logits"] = isinstance(logits, DTensor)
    out["tp_split"] = sorted(n for n, p in model.named_parameters() if _tp_split(p))
    out["head_split"] = _tp_split(model.get_output_embeddings().weight)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    out["norms_on_tp"] = all(
        isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names for p in norms
    )
    out["weights"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _tp_split(p: torch.Tensor) -> bool:
    """Whether `p` is split over tp (under FSDP too: its mesh is then ("dp", "tp"))."""
    if not isinstance(p, DTensor) or p.device_mesh.mesh_dim_names[-1] != "tp":
        return False
    return p.placements[-1].is_shard()


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize(
    "arch,dp_mode,sp",
    [("gpt_neox", "replicate", False), ("gemma2", "replicate", False),
     ("mixtral", "replicate", False), ("gpt_neox", "zero1", False), ("gemma2", "full", False),
     ("mixtral", "full", False),
     ("gpt_neox", "replicate", True), ("gemma2", "full", True), ("mixtral", "zero1", True)],
)  # fmt: skip
def test_dp2_tp2_equals_the_plain_transformers_loop(arch, dp_mode, sp):
    ref = run_ranks(1, _plain, arch, timeout=60)[0]
    got = run_ranks(4, _mesh3d, arch, 2, 2, dp_mode, sp, timeout=60)[0]
    assert ref["loss"][-1] < ref["loss"][0]  # it learns
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(got["grad_norm"], ref["grad_norm"])) <= 1e-5
    assert got["weights"].keys() == ref["weights"].keys()
    assert _max_diff(got["weights"], ref["weights"]) <= 1e-5
    # tp really split the model: the plan's projections and the vocab-parallel head
    assert got["vocab_sharded_logits"]
    assert got["head_split"]
    split = " ".join(got["tp_split"])
    assert ("q_proj" in split or "query_key_value" in split) and "norm" not in split
    # sequence parallelism: every norm runs on this rank's rows, its weight a tp DTensor
    assert got["norms_on_tp"] == sp


def _pipelined(
    rank: int,
    world: int,
    arch: str,
    dp: int,
    tp: int,
    pp: int,
    dp_mode: str,
    schedule: str,
    extra: dict,
) -> dict:
    """One decoder layer a stage (the first with the embedding, the last with the norm and
    head), pp stages or 2 per rank for multi-stage schedules, 2 microbatches per dp rank."""
    from mesh3d.parallel.pipeline import is_multi_stage, pipeline_stage, stage_ids_of_rank

    n_stages = 2 * pp if is_multi_stage(schedule) else pp
    torch.manual_seed(0)
    model = tiny(arch, num_hidden_layers=n_stages, **extra)
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=dp, tp=tp, pp=pp), "cpu")
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    ids = stage_ids_of_rank(pp_rank, pp, n_stages // pp, schedule)
    parts = [mesh3d.build_hf_stage(model, i, n_stages, [i]) for i in ids]
    for part in parts:
        mesh3d.parallelize_hf(part, mesh, dp_mode=dp_mode)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, eps=1e-6, foreach=False)
    dp_group, dp_rank, per, n_mb = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), GBS // dp, 2
    scale = dp if dp_mode != "replicate" else 1
    stages = [pipeline_stage(part, i, n_stages, torch.device("cpu"), pp_group,
                             microbatch_size=per // n_mb, seq_len=SEQ, seq_len_local=SEQ,
                             hidden_size=SMALL["hidden_size"], vocab_size=VOCAB,
                             dtype=torch.float32) for i, part in zip(ids, parts)]  # fmt: skip

    def loss_fn(logits, labels):
        return mesh3d.normalized_loss(logits, labels, VOCAB, GBS * SEQ) * scale

    scheduled = mesh3d.build_schedule(schedule, stages, n_mb, loss_fn)
    out = {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        mine = _batch(step)[dp_rank * per : (dp_rank + 1) * per]
        losses = mesh3d.run_schedule(scheduled, stages, mine[:, :-1], mine[:, 1:])
        if dp_mode == "replicate":
            for part in parts:
                mesh3d.allreduce_gradients(part, dp_group)
        squares = sum(_full(p.grad).double().square().sum() for p in params)
        dist.all_reduce(squares, group=pp_group)
        out["grad_norm"].append(float(squares.sqrt()))
        optimizer.step()
        optimizer.zero_grad()
        total = (sum(losses) / scale) if losses else torch.zeros(())
        for group in (pp_group, dp_group):
            dist.all_reduce(total, group=group)
        out["loss"].append(float(total))
    mine = {n: _full(p) for part in parts for n, p in part.named_parameters()}
    gathered = [None] * pp
    dist.all_gather_object(gathered, mine, group=pp_group)
    out["weights"] = {k: v for got in gathered for k, v in got.items()}
    out["layers_match_stages"] = sorted(
        {n.split(".")[2] for n in mine if ".layers." in n}
    ) == sorted(str(i) for i in ids)  # the names of the full model: layer i on stage i
    return out


@pytest.mark.parametrize(
    "arch,dims,dp_mode,schedule",
    [("gpt_neox", (1, 1, 2), "replicate", "1f1b"), ("gpt_neox", (2, 2, 2), "zero1", "1f1b"),
     ("mixtral", (2, 2, 2), "replicate", "1f1b"),
     ("gpt_neox", (1, 1, 2), "replicate", "interleaved_1f1b"),
     ("gemma2", (1, 2, 2), "replicate", "zbv_zero_bubble"),
     ("gemma2", (2, 2, 2), "full", "interleaved_1f1b")],
)  # fmt: skip
def test_pipelined_stages_equal_the_plain_transformers_loop(arch, dims, dp_mode, schedule):
    # Gemma 2 untied (stages cannot split a tie yet), its sliding layers' window inside the batch
    extra = {"tie_word_embeddings": False, "sliding_window": 4} if arch == "gemma2" else {}
    got = run_ranks(dims[0] * dims[1] * dims[2], _pipelined, arch, *dims, dp_mode, schedule,
                    extra, timeout=90)  # fmt: skip
    ref = run_ranks(1, _plain, arch, num_hidden_layers=_layers(got[0]), **extra, timeout=60)[0]
    assert all(r["layers_match_stages"] for r in got)
    got = got[0]
    assert max(abs(a - b) for a, b in zip(got["loss"], ref["loss"])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(got["grad_norm"], ref["grad_norm"])) <= 1e-5
    assert got["weights"].keys() == ref["weights"].keys()
    assert _max_diff(got["weights"], ref["weights"]) <= 1e-5


def _layers(result: dict) -> int:
    return len({n.split(".")[2] for n in result["weights"] if ".layers." in n})


def _refused(rank: int, world: int, dims: dict, **extra) -> str:
    model = tiny("gpt_neox", **extra)
    mesh = mesh3d.build_mesh(mesh3d.ParallelDims(**dims), "cpu")
    with pytest.raises(mesh3d.UserError) as caught:
        mesh3d.parallelize_hf(model, mesh)
    return str(caught.value)


def test_what_pp_and_cp_cannot_do_is_refused_in_one_line():
    pp = run_ranks(2, _refused, {"dp": 1, "tp": 1, "pp": 2}, timeout=60)
    assert all(m.startswith("pp: pp=2 needs this rank's stage") and "\n" not in m for m in pp)
    cp = run_ranks(2, _refused, {"dp": 1, "tp": 1, "pp": 1, "cp": 2}, attention_dropout=0.1,
                   timeout=60)  # fmt: skip
    assert all(m.startswith("cp: cp=2 with attention_dropout=0.1") for m in cp), cp
