"""The numbers every estimate of the plan uses, read once from a config (`_Sizes.of(cfg)`)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.config import effective_pp_schedule, padded_vocab_size
from mesh3d.models.spec import spec_of
from mesh3d.parallel.parallelize import dp_mode
from mesh3d.train.build import param_and_compute_dtypes


@dataclass(frozen=True)
class _Sizes:
    """The numbers every estimate uses, read once from a config."""

    b: int  # micro_batch_size
    s: int  # sequence_length
    h: int
    ffn: int
    heads: int
    kv_heads: int
    tp: int
    dp: int
    pp: int
    v: int  # stages per pp rank
    m: int  # microbatches per step
    vocab: int  # real
    padded: int
    e_p: int  # bytes of the param dtype
    e_c: int  # bytes of the compute dtype (autocast, else the param dtype)
    autocast: bool
    sp: bool  # sequence parallel (tp_mode REDUCE_SCATTER, tp > 1)
    recompute: bool
    fsdp: bool  # FSDP2 on dp: zero_stage 1 or full_shard, dp > 1
    mode: str  # dp_mode
    schedule: str
    family: str  # the model family (its spec has the TP plan)

    @classmethod
    def of(cls, cfg) -> _Sizes:
        p, t, mc = cfg.parallelism, cfg.tokens, cfg.model.model_config
        param, autocast = param_and_compute_dtypes(cfg)
        mode = dp_mode(cfg.optimizer.zero_stage, cfg.mesh3d.full_shard)
        return cls(
            t.micro_batch_size, t.sequence_length, mc.hidden_size, mc.intermediate_size,
            mc.num_attention_heads, mc.num_key_value_heads or mc.num_attention_heads,
            p.tp, p.dp, p.pp, cfg.mesh3d.pp_virtual_stages,
            t.batch_accumulation_per_replica, mc.vocab_size, padded_vocab_size(cfg),
            param.itemsize, (autocast or param).itemsize, autocast is not None,
            p.tp_mode == "REDUCE_SCATTER" and p.tp > 1, p.recompute_layer,
            mode != "replicate" and p.dp > 1, mode, effective_pp_schedule(cfg),
            spec_of(mc).family,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def local_tokens(self) -> int:  # the residual stream's tokens on a tp rank
        return self.tokens // self.tp if self.sp else self.tokens
