"""HSDP (`mesh3d.dp_shard`): FSDP inside groups of dp_shard dp ranks, replicated across groups.

dp_replicate 2 x dp_shard 2 x tp 2 (8 ranks; full shard inside the groups, sequence parallel)
and the same with pp 2 (16 ranks; zero_stage 1 inside the groups) train like one process within
1e-5; the parameters are DTensors on a ("dp_replicate", "dp_shard") mesh, sharded over the
second and bitwise equal across the first. Checkpoints cross layouts: a one-process step-2
checkpoint resumes under HSDP, and an HSDP step-2 checkpoint resumes at one process, each
continuing the one-process run within 1e-5.

Launches: 1 rank (the reference and its step-2 save), 8 ranks, 16 ranks, 1 rank (the resume).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist import run_ranks
from parity import TINY, full_weights, layout_overrides, max_rel_diff, train_runs
from torch.distributed.tensor import DTensor, Replicate

STEPS = ["tokens.train_steps=4", "model.model_config.num_hidden_layers=4"]


def _ck(root, name: str, resume: str | None = None) -> list[str]:
    out = [f"checkpoints.checkpoints_path={root / name}", "checkpoints.checkpoint_interval=2"]
    return out + ([f"checkpoints.resume_checkpoint_path={root / resume}"] if resume else [])


def _hsdp_runs(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """`train_runs`' results, plus how the parameters are laid out and whether the replica
    groups hold the same shards."""
    from mesh3d.config import apply_overrides, config_from_dict
    from mesh3d.train.hooks import KeepModel
    from mesh3d.train.loop import train

    out = []
    for overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
        res = train(cfg, hooks=[KeepModel()])
        p = next(q for n, q in res.model.named_parameters() if n.endswith("q_proj.weight"))
        assert isinstance(p, DTensor)
        places = dict(zip(p.device_mesh.mesh_dim_names, p.placements, strict=True))
        group = p.device_mesh.get_group("dp_replicate")
        local = p.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, local, group=group)
        weights = full_weights(res.model, res.mesh)  # every rank: the stages are gathered
        out.append(dict(
            loss=[m["lm_loss"] for m in res.metrics], grad_norm=[m["grad_norm"] for m in res.metrics],
            weights=weights if rank == 0 else None,
            layout={n: str(pl) for n, pl in places.items()},
            hsdp=places["dp_replicate"] == Replicate() and _sharded_dim0(places["dp_shard"]),
            replicas_equal=all(torch.equal(c, copies[0]) for c in copies),
        ))  # fmt: skip
    return out


def _sharded_dim0(placement) -> bool:
    """Shard(0), or FSDP's strided Shard(0) over a tp-sharded dim 0 (`_StridedShard`)."""
    return type(placement).__name__ in ("Shard", "_StridedShard") and placement.dim == 0


def test_hsdp_equals_one_process_and_checkpoints_cross_layouts(tmp_path):
    one = layout_overrides(1, 1, "ALL_REDUCE", 0, False)
    ref, _ = run_ranks(1, train_runs, [STEPS + one + _ck(tmp_path, "ref"),
                                       STEPS + one + _ck(tmp_path, "one")], timeout=300)[0]  # fmt: skip
    hsdp = layout_overrides(4, 2, "REDUCE_SCATTER", 0, False) + ["mesh3d.dp_shard=2"]
    full, from_one = run_ranks(8, _hsdp_runs, [STEPS + hsdp + _ck(tmp_path, "hsdp"),
                                               STEPS + hsdp + _ck(tmp_path, "hsdp_from_one", "one/2")],
                               timeout=600)[0]  # fmt: skip
    with_pp = layout_overrides(4, 2, "ALL_REDUCE", 1, False) + [
        "mesh3d.dp_shard=2",
        "parallelism.pp=2",
    ]
    piped = run_ranks(16, _hsdp_runs, [STEPS + with_pp], timeout=600)[0][0]
    (back,) = run_ranks(
        1, train_runs, [STEPS + one + _ck(tmp_path, "back", "hsdp/2")], timeout=300
    )[0]
    tail = {**ref, "loss": ref["loss"][2:], "grad_norm": ref["grad_norm"][2:]}
    diffs = {"dp_replicate 2 x dp_shard 2 x tp 2": max_rel_diff(full, ref),
             "... x pp 2, zero 1 in the groups": max_rel_diff(piped, ref),
             "HSDP resumed from one process's step 2": max_rel_diff(from_one, tail),
             "one process resumed from HSDP's step 2": max_rel_diff(back, tail)}  # fmt: skip
    print("\nHSDP vs one process, max relative difference:", {k: f"{v:.1e}" for k, v in diffs.items()},
          "\nparameter layout:", full["layout"])  # fmt: skip
    assert all(v <= 1e-5 for v in diffs.values()), diffs
    for run in (full, from_one, piped):
        assert run["hsdp"] and run["replicas_equal"], run["layout"]
    assert ref["loss"][-1] < ref["loss"][0]
