"""Helpers for layout-parity tests: a tiny fp32 config, training inside ranks, comparisons."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.errors import UserError
from mesh3d.parallel.experts import gather_expert_shard
from mesh3d.parallel.parallelize import canonical_name
from mesh3d.train.hooks import BatchHashes, KeepModel
from mesh3d.train.loop import train

VOCAB = 250  # not a multiple of 4: tp=4 pads the vocabulary

TINY = dict(
    general=dict(project="parity", run="parity", seed=7),
    logging=dict(log_level="warning", log_level_replica="warning"),
    model=dict(
        dtype="float32",
        init_method=dict(std=0.05),
        make_vocab_size_divisible_by=1,
        model_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=16,
            vocab_size=VOCAB,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            is_llama_config=True,
        ),
    ),
    optimizer=dict(
        zero_stage=0,
        weight_decay=0.01,
        clip_grad=0.05,
        accumulate_grad_in_fp32=True,
        learning_rate_scheduler=dict(
            learning_rate=3e-3,
            lr_warmup_steps=1,
            lr_warmup_style="constant",
            lr_decay_style="cosine",
            min_decay_lr=3e-4,
        ),
        # eps 1e-6, not 1e-8: Adam's first update is g / (|g| + eps), so a weight whose gradient
        # is ~1e-8 turns fp32 summation-order noise (~1e-7 relative, different at every layout)
        # into ~1e-4 of its update. Real layout bugs show up at >= 1e-3 either way.
        optimizer_factory=dict(
            name="adamW", adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, torch_adam_is_fused=False
        ),
    ),
    parallelism=dict(dp=1, tp=1, pp=1, tp_mode="ALL_REDUCE"),
    tokens=dict(
        sequence_length=16, train_steps=5, micro_batch_size=2, batch_accumulation_per_replica=4
    ),
    data_stages=[dict(name="s", start_training_step=1, data=dict(dataset=None, seed=3))],
    mesh3d=dict(device="cpu", dummy_data="learnable"),
)


GLOBAL_BATCH = 8  # samples per step at every layout


def layout_overrides(
    dp: int, tp: int, tp_mode: str, zero: int, tied: bool | None, microbatches: int | None = None
) -> list[str]:
    """Overrides for a layout that keep the global batch (8 samples) the same at any dp.

    `microbatches` per dp rank defaults to 4 // dp (at least 2); the microbatch size follows.
    `tied` None leaves tie_word_embeddings alone (a family without that key).
    """
    n = microbatches or max(2, 4 // dp)
    mbs = GLOBAL_BATCH // (dp * n)
    assert mbs * dp * n == GLOBAL_BATCH, (dp, n)
    return [
        f"parallelism.dp={dp}",
        f"parallelism.tp={tp}",
        f"parallelism.tp_mode={tp_mode}",
        f"optimizer.zero_stage={zero}",
        f"tokens.micro_batch_size={mbs}",
        f"tokens.batch_accumulation_per_replica={n}",
    ] + ([] if tied is None else [f"model.model_config.tie_word_embeddings={str(tied).lower()}"])


def full_weights(model: torch.nn.Module, mesh=None) -> dict[str, torch.Tensor]:
    """Every parameter as its full tensor, all pipeline stages merged (call on every rank).

    `model` is one module or a ModuleList of this rank's stages. A tied head that is a separate
    copy on another stage must equal the embedding bitwise, and is then dropped (the
    one-process model has one tied parameter).
    """
    stages = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    out = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            if getattr(p, "expert_shard", None) is not None:  # expert parallelism: all experts
                t = gather_expert_shard(t.detach(), p.expert_shard)
            out[canonical_name(name)] = t.detach().cpu().clone()
    if mesh is not None and mesh["pp"].size() > 1:
        parts = [None] * mesh["pp"].size()
        dist.all_gather_object(parts, out, group=mesh["pp"].get_group())
        out = {k: v for part in parts for k, v in part.items()}
    if getattr(stages[0], "tie_word_embeddings", False) and "lm_head.weight" in out:
        assert torch.equal(out["lm_head.weight"], out["embed_tokens.weight"]), "tied copies differ"
        del out["lm_head.weight"]
    return out


def replica_mismatches(model: torch.nn.Module, mesh) -> list[str]:
    """Names of parameters whose replicas differ bitwise across the dp, cp or tp ranks holding
    them.

    A parameter is replicated over a mesh axis when it is not a DTensor on that axis, or is one
    with a `Replicate()` placement there (norm weights under tensor parallelism, every
    parameter under zero_stage 0 across dp and cp). FSDP over dp x cp shards on a flattened
    "dp_cp" dimension, which covers both axes.
    """
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        for axis in ("dp", "cp", "tp"):
            if axis not in mesh.mesh_dim_names or mesh[axis].size() == 1:
                continue
            if axis == "dp" and getattr(p, "expert_shard", None) is not None:
                continue  # each rank of an ep group holds other experts
            if isinstance(p, DTensor):
                dims = [
                    i for i, n in enumerate(p.device_mesh.mesh_dim_names) if axis in n.split("_")
                ]
                if any(not isinstance(p.placements[i], Replicate) for i in dims):
                    continue
            group = mesh[axis].get_group()
            copies = [torch.empty_like(local) for _ in range(mesh[axis].size())]
            dist.all_gather(copies, local.detach().contiguous(), group=group)
            if not all(torch.equal(c, copies[0]) for c in copies):
                bad.append(f"{name} across {axis}")
    return bad


def train_runs(rank: int, world: int, runs: list[list[str]], base: dict = TINY) -> list[dict]:
    """Inside a rank: train each override list in turn; losses, grad norms, rank-0 weights."""
    results = []
    for overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(base)), overrides)
        res = train(cfg, hooks=KeepModel())  # one hook, not in a list: `train` takes it too
        weights = full_weights(res.model, res.mesh)
        mismatches = replica_mismatches(res.model, res.mesh)
        results.append(
            dict(
                loss=[m["lm_loss"] for m in res.metrics],
                grad_norm=[m["grad_norm"] for m in res.metrics],
                weights=weights if rank == 0 else None,
                replica_mismatches=mismatches,
                moe=[
                    (m["moe_aux_loss"], m["moe_load_max"])
                    for m in res.metrics
                    if "moe_aux_loss" in m
                ],
            )
        )
    return results


class SampleLengths:
    """The token length of each step's first microbatch on this rank (None: none read)."""

    def __init__(self):
        self.lengths: list[int | None] = []

    def on_step(self, run, step: int, out, metrics: dict) -> None:
        self.lengths.append(out.batches[0][0].shape[-1] if out.batches else None)


def hashed_runs(rank: int, world: int, runs: list[list[str]]) -> list:
    """Train TINY + each run's overrides on this rank: {"loss": per step, "hashes": of the
    batches read, "lengths": their sample lengths}, or the one line of the `UserError` a run
    stopped with."""
    out = []
    for overrides in runs:
        cfg = apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)
        hashes, lengths = BatchHashes(), SampleLengths()
        try:
            res = train(cfg, hooks=[hashes, lengths])
        except UserError as e:
            out.append(str(e))
            continue
        out.append({"loss": [m["lm_loss"] for m in res.metrics], "hashes": hashes.hashes,
                    "lengths": lengths.lengths})  # fmt: skip
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| — the relative difference used by every parity assertion."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_diff(run: dict, ref: dict, vocab: int = VOCAB) -> float:
    """Largest relative difference over losses, grad norms and every weight (real vocab rows)."""
    diffs = [rel(torch.tensor(run["loss"]), torch.tensor(ref["loss"]))]
    diffs.append(rel(torch.tensor(run["grad_norm"]), torch.tensor(ref["grad_norm"])))
    assert run["weights"].keys() == ref["weights"].keys()
    for name, w in ref["weights"].items():
        got = run["weights"][name]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            w, got = w[:vocab], got[:vocab]
        assert got.shape == w.shape, (name, got.shape, w.shape)
        diffs.append(rel(got, w))
    return max(diffs)
