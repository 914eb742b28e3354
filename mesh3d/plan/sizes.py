"""The numbers every estimate of the plan uses, read once from a config's run layout
(`_Sizes.of(cfg)`, from `RunLayout.resolve`)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.config import effective_pp_schedule, max_sequence_length, world_size
from mesh3d.layout import RunLayout


@dataclass(frozen=True)
class _Sizes:
    """The numbers every estimate uses, read once from a config."""

    b: int  # micro_batch_size
    s: int  # sequence_length: the longest of the run (a data stage may be longer)
    h: int
    ffn: int
    heads: int
    kv_heads: int
    tp: int
    dp: int
    pp: int
    cp: int  # context parallelism: each rank holds s/cp tokens of every sample
    v: int  # stages per pp rank
    m: int  # microbatches per step
    vocab: int  # real
    padded: int
    e_p: int  # bytes of the param dtype
    e_c: int  # bytes of the compute dtype (autocast, else the param dtype)
    autocast: bool
    sp: bool  # sequence parallel (tp_mode REDUCE_SCATTER, tp > 1)
    docs: bool  # document masking
    positions: bool  # RoPE gets positions [b, s/cp]: document masking, or cp > 1
    recompute: bool
    fsdp: bool  # FSDP2 on dp x cp: zero_stage 1 or full_shard, dp x cp > 1
    mode: str  # dp_mode
    schedule: str
    family: str  # the model family (its spec has the TP plan)
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts
    experts: int = 0  # E
    top_k: int = 0  # k
    moe_ffn: int = 0  # each expert's intermediate size
    shared_ffn: int = 0  # the shared expert's, 0 without one
    ep: int = 1  # expert parallelism: each rank of an ep group holds E / ep experts
    dispatcher: str = "alltoall"  # moe_config.token_dispatcher_type: alltoall | allgather
    bucket_cap: int = 25 * 2**20  # model.ddp_bucket_cap_mb in bytes (zero_stage 0's buckets)
    recompute_mode: str = "none"  # none | full | selective (`layout.recompute_mode`)
    recompute_every: int = 1  # only layers whose index is a multiple of it are recomputed
    dp_shard: int = 0  # HSDP (`mesh3d.dp_shard`): FSDP groups of this many dp ranks; 0: none

    @classmethod
    def of(cls, cfg) -> _Sizes:
        p = cfg.parallelism
        cp = p.context_parallel_size
        z = RunLayout.resolve(cfg, world_size(cfg))
        s, compute = z.shape, z.autocast_dtype or z.param_dtype
        moe = getattr(cfg.model.model_config, "moe_config", None)
        return cls(
            z.microbatch_size, max_sequence_length(cfg), s.hidden_size, s.intermediate_size,
            s.num_heads, s.num_kv_heads, p.tp, p.dp, p.pp, cp, z.virtual_stages, z.microbatches,
            z.vocab_size, z.padded_vocab, z.param_dtype.itemsize, compute.itemsize,
            z.autocast_dtype is not None, z.sequence_parallel, z.documents,
            z.positions_everywhere, z.recompute != "none",
            z.dp_mode != "replicate" and p.dp * cp > 1, z.dp_mode, effective_pp_schedule(cfg),
            z.spec.family, s.moe_layers, s.num_experts, s.top_k, s.moe_ffn, s.shared_ffn,
            max(1, p.expert_parallel_size), getattr(moe, "token_dispatcher_type", "alltoall"),
            bucket_cap=cfg.model.ddp_bucket_cap_mb * 2**20,
            recompute_mode=z.recompute, recompute_every=z.recompute_every,
            dp_shard=z.dp_shard or 0,
        )  # fmt: skip

    def recomputed(self, layer: int) -> bool:
        """Whether decoder layer `layer` runs under activation checkpointing."""
        return self.recompute and layer % self.recompute_every == 0

    @property
    def tokens(self) -> int:  # a microbatch's tokens on a rank: its cp share
        return self.b * self.s // self.cp

    @property
    def local_tokens(self) -> int:  # the residual stream's tokens on a tp rank
        return self.tokens // self.tp if self.sp else self.tokens

    @property
    def replicas(self) -> int:  # the ranks that hold the same parameters: dp x cp
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:  # the ranks that hold the same experts: dp/ep x cp
        return self.dp // self.ep * self.cp

    def replica_index(self, coords: dict[str, int]) -> int:  # in the flattened dp x cp group
        return coords["dp"] * self.cp + coords["cp"]

    @property
    def shards(self) -> int:  # FSDP's shard group: dp x cp, or dp_shard x cp under HSDP
        return self.dp_shard * self.cp if self.dp_shard else self.replicas

    @property
    def replica_groups(self) -> int:  # HSDP's groups holding the same shards (1: plain FSDP)
        return self.replicas // self.shards

    def shard_index(self, coords: dict[str, int]) -> int:  # in this rank's FSDP shard group
        return self.replica_index(coords) % self.shards
