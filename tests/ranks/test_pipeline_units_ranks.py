"""Pipeline building blocks: Nanotron's stage split, stage placement, stage copies of the model,
and every schedule's gradients against one process (2 forked ranks, gloo, fp32; plus
pp 2 x tp 2 with tied embeddings on 4 ranks).

This file holds the tests of that subject that need a process group; the others are in
`tests/unit/test_pipeline_units.py`."""

import contextlib
import functools

import pytest
import torch
from dist import run_ranks
from test_pipeline_units import PADDED_VOCAB, meta_llama, split_of, tiny_cfg
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from mesh3d.models.init import init_weights
from mesh3d.models.llama import Llama
from mesh3d.models.llama_spec import llama_tp_plan
from mesh3d.parallel.pipeline import (
    SCHEDULES,
    build_schedule,
    build_stage,
    is_multi_stage,
    pipeline_stage,
    rank_of_stage,
    run_schedule,
    stage_ids_of_rank,
    sync_tied_embeddings,
)
from mesh3d.parallel.tensor import apply_tp
from mesh3d.train.loss import normalized_loss

MBS, SEQ, N_MB, PP = 2, 8, 4, 2


CASES = [(name, False, 1) for name in SCHEDULES] + [
    ("1f1b", True, 1),  # tied copies on two ranks
    ("interleaved_1f1b", True, 1),
    ("zbv_zero_bubble", True, 1),  # tied copies on one rank (V placement)
]


# pp 2 x tp 2: vocab-parallel embedding (its gradient comes back Replicate, the head's Shard(0)),
# vocab-sharded DTensor logits under loss_parallel; sequence parallel halves the hidden states.
TP_CASES = [("1f1b", True, 2), ("zbv_zero_bubble", True, 2)]


def _data(cfg):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (N_MB * MBS, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (N_MB * MBS, SEQ), generator=gen)
    labels[::3, :3] = -100  # ignored tokens: the global count is not simply B*S
    return ids, labels


def _full_model(cfg) -> Llama:
    model = meta_llama(cfg)
    model.to_empty(device="cpu")
    init_weights(model, std=0.05, num_layers=cfg.num_hidden_layers, seed=11)
    return model


def _reference(cfg, loss_fn):
    """Gradients (by parameter name, tied alias included) and loss of one process."""
    model = _full_model(cfg)
    ids, labels = _data(cfg)
    total = 0.0
    for mb_ids, mb_labels in zip(ids.chunk(N_MB), labels.chunk(N_MB)):
        loss = loss_fn(model(mb_ids), mb_labels)
        loss.backward()
        total += loss.item()
    tied = model.tied_parameters
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return {n: grads[tied.get(n, n)] for n in grads}, total


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _stage_modules(name, cfg, num_stages, stage_ids, tp_mesh, sequence_parallel):
    """This rank's stage modules, weights copied by name from the full model."""
    split = split_of(cfg, num_stages)
    weights = _full_model(cfg).state_dict()
    modules = []
    for s in stage_ids:
        module = build_stage(meta_llama(cfg), s, num_stages, split[s])
        if tp_mesh is not None:
            apply_tp(module, tp_mesh, llama_tp_plan(sequence_parallel))
        module.to_empty(device="cpu")
        module.tie_weights()
        with torch.no_grad():
            for n, p in module.named_parameters():
                if isinstance(p, DTensor):
                    full = distribute_tensor(weights[n], tp_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(full.to_local())
                else:
                    p.copy_(weights[n])
        modules.append(module)
    return modules


def _run_case(rank: int, name: str, tied: bool, tp: int) -> dict:
    cfg = tiny_cfg(tied=tied)
    ids, labels = _data(cfg)
    tokens = int((labels != -100).sum())
    loss_fn = functools.partial(normalized_loss, vocab_size=cfg.vocab_size, global_tokens=tokens)
    ref_grads, ref_loss = _reference(cfg, loss_fn)

    pp_group, pp_rank, tp_mesh = None, rank, None  # tp 1: the default group is the pp group
    if tp > 1:
        mesh = init_device_mesh("cpu", (PP, tp), mesh_dim_names=("pp", "tp"))
        pp_group, pp_rank, tp_mesh = mesh["pp"].get_group(), mesh["pp"].get_local_rank(), mesh["tp"]
    sequence_parallel = name == "1f1b"  # (tp > 1 only) the other tp case runs ALL_REDUCE
    virtual = 2 if is_multi_stage(name) else 1
    num_stages = PP * virtual
    stage_ids = stage_ids_of_rank(pp_rank, PP, virtual, name)
    modules = _stage_modules(name, cfg, num_stages, stage_ids, tp_mesh, sequence_parallel)
    seq_local = SEQ // tp if tp > 1 and sequence_parallel else SEQ
    kw = dict(microbatch_size=MBS, seq_len=SEQ, seq_len_local=seq_local, hidden_size=32)
    kw.update(vocab_size=PADDED_VOCAB, dtype=torch.float32)
    cpu = torch.device("cpu")
    stages = [
        pipeline_stage(m, s, num_stages, cpu, pp_group, **kw) for m, s in zip(modules, stage_ids)
    ]
    schedule = build_schedule(name, stages, N_MB, loss_fn)
    has_first, has_last = 0 in stage_ids, num_stages - 1 in stage_ids
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        losses = run_schedule(
            schedule, stages, ids if has_first else None, labels if has_last else None
        )
    sync_tied_embeddings(modules, pp_group, 0, rank_of_stage(num_stages - 1, PP, name))

    grads = {n: _full(p.grad) for m in modules for n, p in m.named_parameters()}
    errors = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm()) for n, g in grads.items()}
    out = {"errors": errors, "n_losses": len(losses)}
    if losses:
        out["loss"] = (float(_full(sum(loss.detach() for loss in losses))), ref_loss)
    ends = ("embed_tokens.weight", "lm_head.weight")
    out["tied_grads"] = {n: g for n, g in grads.items() if n in ends} if tied else {}
    return out


def _all_cases(rank: int, world: int, cases: list) -> dict:
    return {case: _run_case(rank, *case) for case in cases}


@pytest.fixture(scope="module")
def pipeline_results():
    results = run_ranks(PP, _all_cases, CASES, timeout=120)
    return results + run_ranks(PP * 2, _all_cases, TP_CASES, timeout=120)


@pytest.mark.parametrize(
    "case",
    CASES + TP_CASES,
    ids=[f"{n}{'-tied' if t else ''}-tp{tp}" for n, t, tp in CASES + TP_CASES],
)
def test_schedule_gradients_and_loss_match_one_process(pipeline_results, case):
    name, tied, tp = case
    per_rank = [r[case] for r in pipeline_results if case in r]
    assert len(per_rank) == PP * tp
    names = [n for r in per_rank for n in r["errors"]]
    expected = {n for n, _ in _full_model(tiny_cfg(tied=tied)).named_parameters()}
    if tied:
        expected.add("lm_head.weight")
    assert sorted(set(names)) == sorted(expected)  # every parameter, on one pp rank (x tp)
    assert len(names) == tp * len(expected)
    worst = max((e, n) for r in per_rank for n, e in r["errors"].items())
    assert worst[0] <= 1e-5, f"{name}: gradient of {worst[1]} differs by {worst[0]:.2e}"
    last = [r for r in per_rank if "loss" in r]
    assert len(last) == tp and all(r["n_losses"] == N_MB for r in last)
    got, ref = last[0]["loss"]
    assert abs(got - ref) <= 1e-5 * abs(ref)
    if tied:  # both copies got the same summed gradient, bitwise
        grads = {n: g for r in per_rank for n, g in r["tied_grads"].items()}
        assert torch.equal(grads["embed_tokens.weight"], grads["lm_head.weight"])
