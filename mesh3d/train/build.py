"""Build what one rank trains: its model parts (one module, or its pipeline stages) and schedule.

Every part is built on `meta`, then `parallelize`d (TP -> recompute -> compile -> materialize +
init -> DP). Pipeline stages get explicit shapes: no communication at construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mesh3d import extensions
from mesh3d.checkpoint.folder import is_hf_folder
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.checkpoint.training import lora_of
from mesh3d.config import ExistingCheckpointInit, SpectralMupInit
from mesh3d.layout import RunLayout
from mesh3d.log import logger
from mesh3d.mesh import groups_of
from mesh3d.parallel.parallelize import FullSource, parallelize, seeded_init
from mesh3d.parallel.pipeline_layout import (
    SCHEDULES,
    rank_of_stage,
    split_by_cost,
    stage_ids_of_rank,
)
from mesh3d.train.loss import step_loss


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
    loss_fn: object = None  # train/loss.py::step_loss of the run: what every path backpropagates
    expert_replicas: object = None  # with expert parallelism: the group expert grads sum over
    reducers: list = field(default_factory=list)  # zero_stage 0 over dp x cp: parallel/buckets.py
    params_of: Callable | None = None  # a transformers model's saved names (train/hf_parts.py)
    seq_len: int = 0  # the sequence length `stages` and `schedule` are declared for
    reshape: Callable[[int], tuple[list, object]] | None = None  # (stages, schedule) at a length
    _shaped: dict = field(default_factory=dict)

    def pipeline_at(self, seq_len: int) -> tuple[list, object]:
        """(stages, schedule) for samples of `seq_len` tokens, made once per length; every rank
        switches at the same step, so the stages' messages stay paired."""
        if seq_len == self.seq_len or self.reshape is None:
            return self.stages, self.schedule
        if seq_len not in self._shaped:
            self._shaped[seq_len] = self.reshape(seq_len)
        return self._shaped[seq_len]

    def named_parameters(self):
        """(name, parameter) over every module; names are the full model's names."""
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]


def initial_weights(cfg, layout: RunLayout) -> FullSource:
    """Where the first weights come from: `init_method: {std: ...}` (or µP's rules) draws each
    full tensor from its own seed; `init_method: {path: ...}` reads a Hugging Face folder or a
    checkpoint in Nanotron's layout saved at any tp/pp."""
    mc, init = cfg.model.model_config, cfg.model.init_method
    shape, spec, seed = layout.shape, layout.spec, layout.seed
    if isinstance(init, ExistingCheckpointInit):
        path = Path(init.path)
        if is_hf_folder(path):  # a Hugging Face model folder, read as `from-hf` would
            full = extensions.load("hf_init").read_hf_for_run(path, mc, layout.padded_vocab)
            where = f"{path} (Hugging Face)"
        else:
            from mesh3d.checkpoint.load import not_a_checkpoint

            error = not_a_checkpoint(path)
            if error is not None:
                raise error
            if lora_of(path) is not None:  # adapters only: not a model to start from
                raise extensions.load("lora_files").not_a_base(path)
            full, where = read_nanotron_weights(path / "model", shape), path / "model"
        n = sum(t.numel() for t in full.values())
        logger.info(f"Initial weights from {where}: {len(full)} tensors, {n:,} parameters")
        tied = {"lm_head.weight": "embed_tokens.weight"} if shape.tied else {}
        return lambda name, shape: full[tied.get(name, name)]
    rows = {"embed_tokens.weight": mc.vocab_size, "lm_head.weight": mc.vocab_size}
    if isinstance(init, SpectralMupInit):
        rules = extensions.load("mup").mup_rules(spec, shape, mc.vocab_size)
        return seeded_init(lambda name: rules[name].std, seed, rows)
    scaling = getattr(init, "scaling_method", "NUM_LAYERS")
    init_std = spec.init_for(mc) if spec.init_for is not None else spec.init_std
    return seeded_init(
        lambda name: init_std(name, init.std, mc.num_hidden_layers, scaling), seed, rows
    )


def build_model_parts(cfg, layout: RunLayout, mesh: DeviceMesh, device: torch.device) -> ModelParts:
    """This rank's model parts for `cfg` on `mesh`, parallelized, initialized, ready to train."""
    mc, p, spec = cfg.model.model_config, cfg.parallelism, layout.spec
    vocab = layout.padded_vocab
    with torch.device("meta"):
        full = spec.build(mc, vocab_size=vocab, attention=cfg.mesh3d.attention)
    if cfg.mesh3d.float8:  # on the single-device model, before stages, TP, compile and DP
        extensions.load("float8").apply_float8(full, spec.blocks().moe)
    if cfg.mesh3d.async_tp and device.type != "meta":  # before the first compile
        async_tp = extensions.load("async_tp")
        async_tp.check_async_tp(device, mesh["tp"].get_group())
        async_tp.enable_async_tp(mesh["tp"].get_group())
    loss_fn = step_loss(layout)
    # on meta (a dry run) nothing is filled: a checkpoint's weights are not read
    source = initial_weights(cfg, layout) if device.type != "meta" else None
    if layout.lora is not None and source is not None:  # adapters start as peft's do
        source = extensions.load("lora").with_adapters(source, layout.seed)
    ep, expert_replicas = None, None
    if layout.expert_parallel > 1:  # every rank makes every group, before any stage is built
        dispatcher = mc.moe_config.token_dispatcher_type
        experts = extensions.load("expert_parallel")
        ep, expert_replicas = experts.new_groups(layout.dims, layout.expert_parallel, dispatcher)

    def finish(module: nn.Module) -> nn.Module:
        return parallelize(
            module, mesh, device=device, source=source,
            tp_plan=spec.tp_plan(layout.sequence_parallel, layout.shape) if p.tp > 1 else {},
            recompute_layer=layout.recompute != "none", recompute=layout.recompute,
            recompute_every=layout.recompute_every, dp=layout.dp_mode, dtype=layout.param_dtype,
            compile_classes=spec.compile_classes(p.tp > 1) if cfg.mesh3d.compile else (),
            split_backward=p.pp > 1 and SCHEDULES[layout.schedule].zero_bubble,
            documents=layout.documents, ep=ep, blocks=spec.blocks(), lora=layout.lora,
            dp_shard=layout.dp_shard,
        )  # fmt: skip

    if p.pp == 1:
        parts = ModelParts(modules=[finish(full)], loss_fn=loss_fn, expert_replicas=expert_replicas)
        return _finished(parts, layout, mesh, cfg.model.ddp_bucket_cap_mb)

    from mesh3d.parallel.pipeline import build_schedule, build_stage, pipeline_stage  # pp > 1 only

    name, virtual = layout.schedule, layout.virtual_stages
    n = p.pp * virtual
    split = split_by_cost(*spec.pipeline_costs(layout.shape), n)
    ids = stage_ids_of_rank(layout.coords["pp"], p.pp, virtual, name)
    modules = [finish(build_stage(full, i, n, split[i])) for i in ids]

    def shaped(seq_len: int) -> tuple[list, object]:
        """Pipeline stages of `modules` for `seq_len` tokens, and their schedule."""
        at = replace(layout, sequence_length=seq_len)
        stages = [
            pipeline_stage(
                m, i, n, device, mesh["pp"].get_group(), microbatch_size=at.microbatch_size,
                seq_len=at.cp_sequence, seq_len_local=at.local_sequence,
                hidden_size=mc.hidden_size, vocab_size=vocab, dtype=at.param_dtype,
                logits_dtype=at.logits_dtype,
            )
            for m, i in zip(modules, ids)
        ]  # fmt: skip
        return stages, build_schedule(name, stages, at.microbatches, loss_fn)

    stages, schedule = shaped(layout.sequence_length)
    parts = ModelParts(
        seq_len=layout.sequence_length, reshape=shaped,
        modules=modules, schedule=schedule, stages=stages, has_first=0 in ids,
        has_last=n - 1 in ids, embed_rank=rank_of_stage(0, p.pp, name),
        head_rank=rank_of_stage(n - 1, p.pp, name), loss_fn=loss_fn,
        expert_replicas=expert_replicas,
    )  # fmt: skip
    return _finished(parts, layout, mesh, cfg.model.ddp_bucket_cap_mb)


def _finished(parts: ModelParts, layout: RunLayout, mesh: DeviceMesh, cap_mb: int) -> ModelParts:
    """`parts` with the MoE auxiliary loss's weight in every MoE block and, for zero_stage 0
    over dp x cp > 1, gradient buckets reduced as the last backward goes."""
    if layout.shape.moe_layers:
        extensions.load("moe").set_aux_weights(parts.modules, layout)
    if layout.dp_mode == "replicate" and layout.dims.dp * layout.dims.cp > 1:
        from mesh3d.parallel.buckets import GradBuckets  # loaded only when there is a replica

        group, cap = groups_of(mesh).replicas, cap_mb * 2**20
        parts.reducers = [
            GradBuckets([p for p in m.parameters() if p.requires_grad], group, cap)
            for m in parts.modules
        ]
    return parts
