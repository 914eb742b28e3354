"""Build what one rank trains: its model parts (one module, or its pipeline stages) and schedule.

Every part is built on `meta`, then goes through `parallelize` (TP -> recompute -> materialize
+ init -> DP). With pp > 1 the meta model is first cut into stages (`build_stage`, Nanotron's
cost-based layer split) and each stage this rank runs is parallelized the same way, wrapped in a
`PipelineStage` with explicit shapes (no communication at construction), and handed to the
schedule named by `mesh3d.pp_schedule` or `parallelism.pp_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.config import ExistingCheckpointInit, effective_pp_schedule, padded_vocab_size
from mesh3d.errors import UserError
from mesh3d.models.llama import DTYPES
from mesh3d.models.spec import ModelShape, spec_of
from mesh3d.parallel.parallelize import FullSource, dp_mode, parallelize, seeded_init
from mesh3d.parallel.pipeline import (
    build_schedule,
    build_stage,
    pipeline_stage,
    rank_of_stage,
    split_by_cost,
    stage_ids_of_rank,
)
from mesh3d.train.loss import normalized_loss


@dataclass
class ModelParts:
    """This rank's share of the model: `modules` (one, or its pipeline stages) and schedule."""

    modules: list[nn.Module]
    schedule: object | None = None  # a torch.distributed.pipelining schedule when pp > 1
    stages: list = field(default_factory=list)
    has_first: bool = True  # runs the embedding (needs input ids)
    has_last: bool = True  # runs the head (needs labels, produces the loss)
    embed_rank: int = 0  # pp ranks of the first and last stage (tied-embedding sync)
    head_rank: int = 0

    def named_parameters(self):
        """(name, parameter) over every module; names are the full model's names."""
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]


def param_and_compute_dtypes(cfg) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) for `model.dtype` and fp32 accumulation.

    bf16/fp16 with `accumulate_grad_in_fp32` keeps fp32 parameters (the master weights and
    gradients Nanotron keeps beside bf16 copies) and runs the math under autocast.
    """
    dtype = DTYPES[cfg.model.dtype]
    if dtype == torch.float32:
        return torch.float32, None
    if cfg.optimizer.accumulate_grad_in_fp32:
        return torch.float32, dtype
    return dtype, None


def initial_weights(cfg, padded_vocab: int) -> FullSource:
    """Where the first weights come from: `init_method: {std: ...}` draws each full tensor from
    its own seed; `init_method: {path: ...}` reads them from a checkpoint in Nanotron's layout
    (written by Nanotron, `mesh3d.convert from-hf`, or mesh3d), saved at any tp/pp."""
    mc, init = cfg.model.model_config, cfg.model.init_method
    if isinstance(init, ExistingCheckpointInit):
        path = Path(init.path)
        root = path / "model" if (path / "model").is_dir() else path
        if not root.is_dir():
            raise UserError(f"`model.init_method.path` {path} has no model/ folder of weights")
        full = read_nanotron_weights(root, ModelShape.from_config(cfg))
        tied = {"lm_head.weight": "embed_tokens.weight"} if mc.tie_word_embeddings else {}
        return lambda name, shape: full[tied.get(name, name)]
    scaling = getattr(init, "scaling_method", "NUM_LAYERS")
    init_std = spec_of(mc).init_std
    return seeded_init(
        lambda name: init_std(name, init.std, mc.num_hidden_layers, scaling),
        cfg.general.seed,
        {"embed_tokens.weight": mc.vocab_size, "lm_head.weight": mc.vocab_size},
    )


def build_model_parts(cfg, mesh: DeviceMesh, device: torch.device, dp_scale: int) -> ModelParts:
    """This rank's model parts for `cfg` on `mesh`, parallelized, initialized, ready to train.

    `dp_scale` multiplies the pipeline loss for backward (FSDP averages gradients over dp).
    """
    mc, p = cfg.model.model_config, cfg.parallelism
    spec = spec_of(mc)
    param_dtype, autocast_dtype = param_and_compute_dtypes(cfg)
    vocab = padded_vocab_size(cfg)
    with torch.device("meta"):
        full = spec.build(mc, vocab_size=vocab, attention=cfg.mesh3d.attention)
    sp = p.tp_mode == "REDUCE_SCATTER" and p.tp > 1

    source = initial_weights(cfg, vocab)

    def finish(module: nn.Module) -> nn.Module:
        return parallelize(
            module,
            mesh,
            device=device,
            source=source,
            tp_plan=spec.tp_plan(sp) if p.tp > 1 else {},
            recompute_layer=p.recompute_layer,
            dp=dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard),
            dtype=param_dtype,
            compile_classes=spec.compile_classes(p.tp > 1) if cfg.mesh3d.compile else (),
        )

    if p.pp == 1:
        return ModelParts(modules=[finish(full)])

    name, virtual = effective_pp_schedule(cfg), cfg.mesh3d.pp_virtual_stages
    n = p.pp * virtual
    h = mc.hidden_size
    split = split_by_cost(*spec.pipeline_costs(ModelShape.from_config(cfg)), n)
    pp_rank = mesh["pp"].get_local_rank()
    ids = stage_ids_of_rank(pp_rank, p.pp, virtual, name)
    modules = [finish(build_stage(full, i, n, split[i])) for i in ids]
    seq = cfg.tokens.sequence_length
    stages = [
        pipeline_stage(
            m,
            i,
            n,
            device,
            mesh["pp"].get_group(),
            microbatch_size=cfg.tokens.micro_batch_size,
            seq_len=seq,
            seq_len_local=seq // p.tp if sp else seq,
            hidden_size=h,
            vocab_size=vocab,
            dtype=param_dtype,
            logits_dtype=autocast_dtype or param_dtype,
        )
        for m, i in zip(modules, ids)
    ]
    global_tokens = cfg.tokens.micro_batch_size * cfg.tokens.batch_accumulation_per_replica
    global_tokens *= p.dp * seq

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return normalized_loss(logits, labels, mc.vocab_size, global_tokens) * dp_scale

    schedule = build_schedule(name, stages, cfg.tokens.batch_accumulation_per_replica, loss_fn)
    return ModelParts(
        modules=modules,
        schedule=schedule,
        stages=stages,
        has_first=0 in ids,
        has_last=n - 1 in ids,
        embed_rank=rank_of_stage(0, p.pp, name),
        head_rank=rank_of_stage(n - 1, p.pp, name),
    )
