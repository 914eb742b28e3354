"""One run's layout, resolved once from its config and world size, and passed to every part.

    layout = RunLayout.resolve(cfg, world_size=8, rank=5)
    layout.coords            # {'pp': 1, 'dp': 0, 'cp': 0, 'tp': 1}
    layout.dp_mode           # 'replicate' | 'zero1' | 'full'

torch is imported only for the dtypes; no process group is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mesh3d import extensions
from mesh3d.config import effective_pp_schedule, global_batch_size, padded_vocab_size
from mesh3d.mesh import ParallelDims
from mesh3d.models.dtypes import DTYPES
from mesh3d.models.registry import model_shape, spec_of
from mesh3d.models.spec import ModelShape, ModelSpec


def dp_mode(zero_stage: int, full_shard: bool, dp_shard: int | None = None) -> str:
    """'replicate' (zero 0), 'zero1' or 'full': how parameters live on the dp axis
    (`mesh3d.dp_shard` shards fully unless zero_stage is 1)."""
    if full_shard or (dp_shard is not None and zero_stage == 0):
        return "full"
    return "zero1" if zero_stage > 0 else "replicate"


@dataclass(frozen=True)
class RunLayout:
    """What a run's parts need to know about its layout."""

    dims: ParallelDims
    rank: int
    coords: dict[str, int]
    dp_mode: str
    sequence_parallel: bool  # tp_mode REDUCE_SCATTER with tp > 1
    model_dtype: torch.dtype  # `model.dtype`: what the weights are saved in
    param_dtype: torch.dtype  # fp32 master weights with accumulate_grad_in_fp32
    autocast_dtype: torch.dtype | None  # the compute dtype under autocast, None for fp32
    schedule: str | None  # the pipeline schedule when pp > 1
    virtual_stages: int
    microbatch_size: int
    microbatches: int  # per dp rank and step
    sequence_length: int
    vocab_size: int  # real
    padded_vocab: int
    global_batch: int  # samples per step
    spec: ModelSpec
    shape: ModelShape
    z_loss: float  # the z-loss coefficient, 0 when off
    doc_masking: bool  # attention within documents (Qwen2's _use_doc_masking)
    sft: bool  # a data stage is SFT data: samples carry positions and masked labels
    expert_parallel: int  # ranks of the dp axis the experts are split over (1: none)
    eos_token_id: int | None  # where a document ends (document masking)
    seed: int  # `general.seed`: the initial weights and the dropout masks
    dropout: bool  # the model drops values in training: each token gets a key (`spec.dropout`)
    recompute: str = "none"  # none | full | selective: `recompute_mode(cfg)`
    recompute_every: int = 1  # only layers whose index is a multiple of it are recomputed
    lora: object | None = None  # `models/lora.py::LoraPlan` with `mesh3d.lora`: adapters train
    dp_shard: int | None = None  # HSDP (`mesh3d.dp_shard`): FSDP groups of this many dp ranks

    @classmethod
    def resolve(cls, cfg, world_size: int, rank: int = 0) -> RunLayout:
        p, t, mc = cfg.parallelism, cfg.tokens, cfg.model.model_config
        dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.context_parallel_size)
        dims.validate(world_size)
        param, autocast = param_and_compute_dtypes(cfg)
        return cls(
            dims=dims,
            rank=rank,
            coords=dims.coords(rank),
            dp_mode=dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard, cfg.mesh3d.dp_shard),
            dp_shard=cfg.mesh3d.dp_shard,
            sequence_parallel=p.tp_mode == "REDUCE_SCATTER" and p.tp > 1,
            model_dtype=DTYPES[cfg.model.dtype],
            param_dtype=param,
            autocast_dtype=autocast,
            schedule=effective_pp_schedule(cfg) if p.pp > 1 else None,
            virtual_stages=cfg.mesh3d.pp_virtual_stages,
            microbatch_size=t.micro_batch_size,
            microbatches=t.batch_accumulation_per_replica,
            sequence_length=t.sequence_length,
            vocab_size=mc.vocab_size,
            padded_vocab=padded_vocab_size(cfg),
            global_batch=global_batch_size(cfg),
            spec=spec_of(mc),
            shape=model_shape(cfg),
            z_loss=mc.z_loss_coefficient if getattr(mc, "z_loss_enabled", False) else 0.0,
            doc_masking=bool(getattr(mc, "_use_doc_masking", False)),
            sft=any(
                type(s.data.dataset).__name__ == "SFTDatasetsArgs" for s in cfg.data_stages or []
            ),
            expert_parallel=p.expert_parallel_size,
            eos_token_id=getattr(mc, "eos_token_id", None),
            seed=cfg.general.seed,
            dropout=spec_of(mc).dropout(mc),
            recompute=recompute_mode(cfg),
            recompute_every=cfg.mesh3d.recompute_every,
            lora=lora_plan_of(cfg),
        )

    @classmethod
    def of(cls, cfg, rank: int = 0) -> RunLayout:
        """The layout at the config's own world size (dp x tp x pp x cp)."""
        p = cfg.parallelism
        return cls.resolve(cfg, p.dp * p.tp * p.pp * p.context_parallel_size, rank)

    @property
    def fp32_masters(self) -> bool:
        """Whether fp32 master weights differ from the saved weights: checkpoints then keep
        them in the optimizer files, as Nanotron's `gradient_accumulator` does."""
        return self.param_dtype == torch.float32 and self.model_dtype != torch.float32

    @property
    def logits_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    def activation(self) -> torch.Tensor:
        """What a pipeline stage hands the next for one microbatch, as a meta tensor: hidden
        states [mbs, S_local, h]."""
        shape = (self.microbatch_size, self.local_sequence, self.shape.hidden_size)
        return torch.empty(shape, dtype=self.param_dtype, device="meta")

    @property
    def global_tokens(self) -> int:
        """Tokens per step over all microbatches and dp ranks: the loss's denominator."""
        return self.global_batch * self.sequence_length

    @property
    def backward_scale(self) -> int:
        """FSDP averages gradients over dp x cp (gloo has no PREMUL_SUM to sum them), so the
        backward loss is multiplied by dp x cp to keep the one-process gradient."""
        return self.dims.dp * self.dims.cp if self.dp_mode != "replicate" else 1

    @property
    def positions_everywhere(self) -> bool:
        """Whether every pipeline stage needs each token's position, so every rank reads the
        data: document masking, SFT data or context parallelism."""
        return self.doc_masking or self.sft or self.dims.cp > 1

    @property
    def documents(self) -> bool:
        """Whether attention stays within documents (document masking or SFT examples)."""
        return self.doc_masking or self.sft

    @property
    def cp_sequence(self) -> int:
        """Tokens per sample a cp rank holds (the whole sequence without context parallelism)."""
        return self.sequence_length // self.dims.cp

    @property
    def local_sequence(self) -> int:
        """Tokens of the residual stream a rank holds per sample (its cp share, / tp under SP)."""
        return self.cp_sequence // self.dims.tp if self.sequence_parallel else self.cp_sequence


def lora_plan_of(cfg):
    """The run's `LoraPlan` (`mesh3d.lora`), None without adapters."""
    lora = cfg.mesh3d.lora
    return lora and extensions.load("lora").lora_plan(lora, spec_of(cfg.model.model_config),
                                                      model_shape(cfg))  # fmt: skip


def recompute_mode(cfg) -> str:
    """`mesh3d.recompute` when set, else Nanotron's `parallelism.recompute_layer` (full or none)."""
    if cfg.mesh3d.recompute is not None:
        return cfg.mesh3d.recompute
    return "full" if cfg.parallelism.recompute_layer else "none"


def param_and_compute_dtypes(cfg) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None): bf16/fp16 with `accumulate_grad_in_fp32`
    keeps fp32 parameters and runs the math under autocast."""
    dtype = DTYPES[cfg.model.dtype]
    if dtype != torch.float32 and cfg.optimizer.accumulate_grad_in_fp32:
        return torch.float32, dtype
    return dtype, None
