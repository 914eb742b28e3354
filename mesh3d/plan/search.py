"""`mesh3d plan --search`: every layout of a config's model and global batch on a world size,
ranked by predicted step time (`cost.py`) among those whose peak memory per rank fits.

A candidate sets dp x tp x pp x cp (= world size), ep (mixture of experts: a divisor of dp),
zero stage / full shard, recompute, micro_batch_size x batch_accumulation_per_replica (dp x
their product = the config's global batch in samples), the pipeline schedule and its virtual
stages. Each one is the config with those keys replaced and must pass `validation_errors`
(the checks training runs). Memory and bytes per axis come from the plan's own `rank_plan`
for one representative rank per pp rank (tp, dp, cp index 0 hold the largest shards); the
meta model's stage shapes, the schedules' orders and the per-stage numbers are computed once
per shape and reused across candidates.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from mesh3d.checks.validate import validation_errors
from mesh3d.config import effective_pp_schedule, max_sequence_length
from mesh3d.errors import ConfigError, UserError
from mesh3d.models.registry import model_shape, spec_of
from mesh3d.parallel.pipeline import stage_ids_of_rank
from mesh3d.plan.build import plan_basis, rank_peaks, rank_plan, stage_shapes
from mesh3d.plan.cost import step_time
from mesh3d.plan.hardware import Hardware
from mesh3d.plan.kernels import work_of
from mesh3d.plan.memory import _params
from mesh3d.plan.schedule import _orders, bubble
from mesh3d.plan.sizes import _Sizes

# (schedule, virtual stages) tried when pp > 1
PIPELINES = [("afab", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
             ("interleaved_zero_bubble", 2), ("zbv_zero_bubble", 2)]  # fmt: skip
DP_MODES = [(0, False), (1, False), (1, True)]  # (zero_stage, full_shard)
USABLE = 0.95  # share of the device memory a layout may plan to use (allocator, context)
MAX_WORLD = 2**20  # ranks searched at most: beyond any machine built, and a bounded search


@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero_stage: int
    full_shard: bool
    recompute: bool
    micro_batch_size: int
    batch_accumulation: int
    schedule: str
    virtual_stages: int
    memory_gib: float = 0.0
    fits: bool = False
    step_time_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    dominant: str = ""
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        zero = "full" if self.full_shard else f"z{self.zero_stage}"
        pipe = f" {self.schedule}" + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp}{ep} {zero}"
                f"{' rc' if self.recompute else ''} mbs{self.micro_batch_size}"
                f"x{self.batch_accumulation}{pipe if self.pp > 1 else ''}")  # fmt: skip

    def apply(self, cfg):
        """`cfg` with this layout's keys."""
        p = dataclasses.replace(
            cfg.parallelism, dp=self.dp, tp=self.tp, pp=self.pp, context_parallel_size=self.cp,
            expert_parallel_size=self.ep, recompute_layer=self.recompute,
        )  # fmt: skip
        pipe = {"pp_schedule": self.schedule if self.pp > 1 else None,
                "pp_virtual_stages": self.virtual_stages}  # fmt: skip
        m = dataclasses.replace(cfg.mesh3d, full_shard=self.full_shard, **pipe)
        o = dataclasses.replace(cfg.optimizer, zero_stage=self.zero_stage)
        t = dataclasses.replace(cfg.tokens, micro_batch_size=self.micro_batch_size,
                                batch_accumulation_per_replica=self.batch_accumulation)  # fmt: skip
        return dataclasses.replace(cfg, parallelism=p, mesh3d=m, optimizer=o, tokens=t)

    def overrides(self) -> list[str]:
        return [f"parallelism.dp={self.dp}", f"parallelism.tp={self.tp}",
                f"parallelism.pp={self.pp}", f"parallelism.context_parallel_size={self.cp}",
                f"parallelism.expert_parallel_size={self.ep}",
                f"parallelism.recompute_layer={str(self.recompute).lower()}",
                f"optimizer.zero_stage={self.zero_stage}",
                f"mesh3d.full_shard={str(self.full_shard).lower()}",
                f"mesh3d.pp_schedule={self.schedule if self.pp > 1 else 'null'}",
                f"mesh3d.pp_virtual_stages={self.virtual_stages}",
                f"tokens.micro_batch_size={self.micro_batch_size}",
                f"tokens.batch_accumulation_per_replica={self.batch_accumulation}"]  # fmt: skip


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(cfg, world_size: int):
    """Every layout `validation_errors` accepts at `world_size`, same global batch."""
    t, mc = cfg.tokens, cfg.model.model_config
    batch = cfg.parallelism.dp * t.micro_batch_size * t.batch_accumulation_per_replica
    experts = getattr(getattr(mc, "moe_config", None), "num_experts", 0) or 0
    for tp in _divisors(world_size):
        for cp in _divisors(world_size // tp):
            for pp in _divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                if batch % dp:
                    continue
                pipes = PIPELINES if pp > 1 else [(effective_pp_schedule(cfg), 1)]
                eps = [e for e in _divisors(dp) if experts % e == 0] if experts else [1]
                for ep, (zero, full), rc, mbs, (sched, v) in itertools.product(
                    eps, DP_MODES if dp * cp > 1 else DP_MODES[:1], (False, True),
                    _divisors(batch // dp), pipes,
                ):  # fmt: skip
                    c = Candidate(dp, tp, pp, cp, ep, zero, full, rc, mbs, batch // dp // mbs,
                                  sched, v)  # fmt: skip
                    if not validation_errors(c.apply(cfg), world_size):
                        yield c


class Search:
    """Predicts candidates of one config, caching what several share."""

    def __init__(self, cfg, world_size: int, hw: Hardware, nodes_of: int):
        self.cfg, self.world, self.hw, self.nodes_of = cfg, world_size, hw, nodes_of
        self.spec, self.shape = spec_of(cfg.model.model_config), model_shape(cfg)
        costs, head = self.spec.pipeline_costs(self.shape)
        self.costs, self.head, self.total = costs, head, sum(costs) + head
        self.cache: dict[tuple, object] = {}
        self.batch = cfg.parallelism.dp * cfg.tokens.micro_batch_size
        self.batch *= cfg.tokens.batch_accumulation_per_replica
        self.flops = self.spec.step_flops(self.shape, max_sequence_length(cfg), self.batch)

    def _cached(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def predict(self, c: Candidate) -> Candidate:
        cfg = c.apply(self.cfg)
        z = _Sizes.of(cfg)
        n = z.pp * z.v
        _, split, shapes = self._cached(("shapes", n, z.tp, z.sp, z.ep),
                                        lambda: stage_shapes(cfg, z))  # fmt: skip
        orders = self._cached(("orders", z.schedule, z.pp, z.v, z.m), lambda: _orders(z))
        key = (z.pp, z.v, z.schedule, z.tp, z.sp, z.ep, z.cp, z.b, z.m, z.recompute)
        basis = self._cached(("basis", *key), lambda: plan_basis(cfg, z, split, shapes, orders))
        ranks, shares = [], []
        for r in range(z.pp):
            coords = {"pp": r, "dp": 0, "cp": 0, "tp": 0}
            ids = stage_ids_of_rank(r, z.pp, z.v, z.schedule) if z.pp > 1 else [0]
            params = [
                x for i in ids for x in self._cached(
                    ("params", n, z.tp, z.sp, z.ep, z.fsdp, z.replicas, i),
                    lambda i=i, c=coords: _params(z, shapes[i], c))
            ]  # fmt: skip
            peaks = self._cached(("peaks", *key, r), lambda r=r: rank_peaks(basis, r))
            ranks.append(rank_plan(z, basis, r, coords, params, peaks))
            layers = [i for s in ids for i in split[s]]
            head = any(s == n - 1 for s in ids)
            shares.append((len(layers), sum(map(z.recomputed, layers)), head))
        frac = bubble(z.schedule, z.pp, z.v, z.m).fraction or 0.0
        dims = {"pp": z.pp, "dp": z.dp, "cp": z.cp, "tp": z.tp}
        dtype = str(cfg.model.dtype) if not z.autocast else "bfloat16"
        kind = ("compiled_tp" if z.tp > 1 else "compiled") if cfg.mesh3d.compile else "eager"
        work = self._cached(("work", z.e_c, kind),
                            lambda: work_of(self.spec, self.shape, z.s, z.e_c, kind))  # fmt: skip
        tokens = self.batch * z.s / (z.dp * z.cp)
        t = step_time(ranks, shares, work, tokens, dtype, dims, z.ep, z.m,
                      (z.mode, z.sp, z.recompute_mode, cfg.mesh3d.float8), frac, z.e_p, self.nodes_of, self.hw)  # fmt: skip
        c.memory_gib = max(r.peak_bytes for r in ranks) / 2**30
        c.fits = c.memory_gib <= USABLE * self.hw.memory_gib
        c.step_time_s, c.parts, c.dominant = t.step_s, t.parts, t.dominant
        tokens = self.batch * z.s
        c.tokens_per_s_per_gpu = tokens / t.step_s / self.world
        c.mfu = self.flops / (t.step_s * self.world * self.hw.peak(dtype))
        return c


def check_world(world_size: int) -> None:
    """Refuse a world size the search does not cover (it would run for minutes)."""
    if not 1 <= world_size <= MAX_WORLD:
        raise UserError(
            f"--world-size {world_size}: the layout search covers 1 to {MAX_WORLD:,} ranks "
            f"(2**{MAX_WORLD.bit_length() - 1}); give a world size in that range"
        )


def search(cfg, world_size: int, hw: Hardware, nodes_of: int = 8) -> list[Candidate]:
    """Every valid candidate, predicted; those that fit first, fastest first."""
    check_world(world_size)
    s = Search(cfg, world_size, hw, nodes_of)
    out = [s.predict(c) for c in candidates(cfg, world_size)]
    if not out:
        raise ConfigError(
            f"no layout of this model and global batch ({s.batch} samples) is valid at world "
            f"size {world_size}: dp must divide the global batch, tp the heads, pp the layers; "
            "change --world-size or tokens.batch_accumulation_per_replica"
        )
    out.sort(key=lambda c: (not c.fits, c.step_time_s if c.fits else c.memory_gib))
    return out


def why_not(best: Candidate, hw: Hardware) -> str:
    """What is missing when nothing fits (`best`: the candidate needing the least memory)."""
    need, have = best.memory_gib, USABLE * hw.memory_gib
    helps = []
    if not best.recompute:
        helps.append("recompute (parallelism.recompute_layer)")
    sharded = best.dp * best.cp > 1
    if sharded and (best.zero_stage == 0 or not best.full_shard):
        helps.append("ZeRO-1 / full shard (optimizer.zero_stage, mesh3d.full_shard)")
    more = "" if sharded else ", with ZeRO over the added dp ranks"
    helps.append(f"about {math.ceil(need / have)}x the ranks{more}")
    return (
        f"no layout fits in {hw.name}'s memory: the smallest needs {need:.1f} GiB per rank "
        f"({best.label}), {have:.1f} GiB usable; what would help: {', '.join(helps)}"
    )
