"""The plan as data: `Plan` and its parts. `dataclasses.asdict(plan)` is what `--json` prints."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StagePlan:
    stage: int
    pp_rank: int
    layers: list[int]  # decoder layer indices
    embedding: bool
    head: bool  # final norm + lm_head
    saved_per_microbatch: int  # bytes saved for backward (stage_activation_bytes)
    held_per_microbatch: int  # bytes of the output the schedule keeps until backward


@dataclass
class CommItem:
    """One kind of collective or send of one rank per step."""

    axis: str
    what: str
    collective: str  # all_reduce | all_gather | reduce_scatter | send
    count: int
    bytes_each: int  # the full tensor (all-gather output, reduce-scatter input)
    sent_bytes: int  # what the rank puts on the wire: count x bytes_each x WIRE[collective]
    overlaps: bool = False  # launched while the backward still runs (zero 0's buckets)


@dataclass
class RankPlan:
    rank: int
    coords: dict[str, int]
    stages: list[int]
    param_elements: int
    param_bytes: int
    grad_bytes: int  # at the optimizer step
    optimizer_bytes: int
    saved_activation_bytes: int  # peak over the step of the bytes saved for backward
    activation_bytes: int  # peak of saved + the outputs held by the schedule
    microbatches_in_flight: int  # peak of (stage, microbatch) forwards not yet released
    transient: dict[str, int]  # bytes alive during part of the step, by cause
    peak_bytes: int  # upper estimate: all of the above alive at once
    comm: list[CommItem]


@dataclass
class Bubble:
    fraction: float | None  # idle share of a step; None: no closed form
    formula: str
    kind: str  # exact | approximate | ideal | none


@dataclass
class Plan:
    """The whole plan; `dataclasses.asdict(plan)` is what `--json` prints."""

    world_size: int
    dims: dict[str, int]
    schedule: str
    virtual_stages: int
    microbatches: int
    micro_batch_size: int
    sequence_length: int
    dp_mode: str
    tp_mode: str
    param_dtype: str
    compute_dtype: str
    optimizer: str
    recompute_layer: bool
    tied_embeddings: bool
    padded_vocab: int
    total_params: int  # the whole model, a tied embedding once
    active_params: int  # what one token runs through: total less the experts it is not routed to
    groups: dict[str, list[list[int]]]
    stages: list[StagePlan]
    ranks: list[RankPlan]
    bubble: Bubble
    order_source: str  # where each rank's order of forwards and backwards comes from
    notes: list[str]
    moe: str = ""  # "" without experts, else e.g. "top 2 of 8 experts in layers 1,3"
    trainable_params: int = 0  # what the optimizer updates: all (total), or LoRA's adapters


@dataclass
class BuiltRank:
    """What one representative rank's parts hold, built as training builds them (`--dry-run`)."""

    rank: int
    ranks: list[int]  # every rank it stands for
    coords: dict[str, int]
    stages: list[int]  # the pipeline stages it built
    param_elements: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    schedule: str  # the schedule class, "" without pipeline parallelism
    seconds: float


@dataclass
class DryRun:
    """Every representative rank of a dry run (`mesh3d.plan.dry_run`)."""

    world_size: int
    built: list[BuiltRank]
    seconds: float  # every representative, process groups included
