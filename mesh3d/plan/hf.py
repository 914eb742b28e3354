"""`mesh3d plan --hf-model FOLDER`: the memory of any `transformers` causal LM on a layout, read
off its own module tree rather than a family's formulas.

For each pipeline stage, torch's fake process group (every collective returns at once) is started
as that stage's first rank of the whole world, and the model is built on `meta` from its config,
cut with `build_hf_stage` (layers split by their parameter counts, the head's counted on the
last stage, `split_by_cost`) and parallelized with `parallelize_hf` as a training rank would:
- parameters, gradients and AdamW state are the local tensors of that build (TP shards, FSDP
  shards under zero1 / full);
- activations are the bytes autograd saves for backward in one microbatch's forward of the
  stage (a saved-tensor hook counts them; run on meta with a 4D causal mask, so the model's
  mask code needs no data), plus the loss's copy of the logits on the last stage. On meta
  attention takes SDPA's math path, which saves the attention probabilities: an upper bound of
  what fused kernels save (tiny GPT-NeoX, 2 x 32 tokens: equal to a real CPU forward on the
  math path, 1.11x one on CPU's default kernel). A forward
  meta tensors cannot run (MoE routing depends on the data) leaves them unmeasured, said so.
- peak = parameters + gradients + optimizer state + activations x the microbatches in flight
  (1F1B: pp - stage; one without pipeline parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.errors import UserError
from mesh3d.hf_models import decoder_layers, load_hf_config, parallelize_hf
from mesh3d.hf_stages import build_hf_stage, hf_stage_layers
from mesh3d.mesh import ParallelDims, build_mesh
from mesh3d.plan.dry_run import fake_world


@dataclass
class HFStagePlan:
    """One pipeline stage as its first rank holds it; bytes."""

    stage: int
    layers: list[int]
    params: int  # local elements
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None  # one microbatch; None: not measured (see HFPlan.note)
    in_flight: int
    peak_bytes: int


@dataclass
class HFPlan:
    model: str
    total_params: int
    dp: int
    tp: int
    pp: int
    dp_mode: str
    micro_batch: int
    sequence_length: int
    microbatches: int
    stages: list[HFStagePlan] = field(default_factory=list)
    note: str | None = None


def plan_hf(source, *, dp: int = 1, tp: int = 1, pp: int = 1, dp_mode: str = "replicate",
            micro_batch: int = 1, sequence_length: int = 1024, microbatches: int = 1) -> HFPlan:  # fmt: skip
    """The plan (module docstring) of the `transformers` causal LM `source` (a model object,
    whose config is used, or a local folder / hub id: only its config is read) at dp x tp x pp.

    Example:

        from mesh3d.plan.hf import plan_hf, format_hf_plan
        print(format_hf_plan(plan_hf("models/pythia-160m", tp=2, pp=2, sequence_length=2048)))
    """
    if dist.is_initialized():  # (and torch keeps meshes of those worlds: a process of its own)
        raise UserError("plan: plan_hf starts its own fake process group; call it outside a run")
    config = source.config if isinstance(source, nn.Module) else load_hf_config(source)
    import transformers

    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(config)
    split = hf_stage_layers(full, pp) if pp > 1 else [list(range(_count_layers(full)))]
    plan = HFPlan(type(full).__name__, sum(p.numel() for p in full.parameters()), dp, tp, pp,
                  dp_mode, micro_batch, sequence_length, microbatches)  # fmt: skip
    dims = ParallelDims(dp=dp, tp=tp, pp=pp)
    for s in range(pp):
        rank = next(r for r in range(dims.world_size) if dims.coords(r) == {"pp": s, "dp": 0, "cp": 0, "tp": 0})  # fmt: skip
        with fake_world(rank, dims.world_size):
            mesh = build_mesh(dims, "cpu")
            built = _part(config, s, pp, split[s], mesh, dp_mode)
            local = [_local(p) for p in built.parameters()]
            param_bytes = sum(t.numel() * t.element_size() for t in local)
            try:
                acts = _activation_bytes(_part(config, s, pp, split[s], mesh, "replicate"),
                                         s == 0, s == pp - 1, micro_batch, sequence_length,
                                         config, tp)  # fmt: skip
            except Exception as err:  # meta cannot run every model: say so, plan the rest
                acts = None
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                plan.note = f"activations not measured: a forward on meta failed ({first[:160]})"
        in_flight = min(pp - s, microbatches) if pp > 1 else 1
        optimizer = 2 * param_bytes + 4 * len(local)  # exp_avg, exp_avg_sq; a step per tensor
        peak = 2 * param_bytes + optimizer + (acts or 0) * in_flight
        plan.stages.append(HFStagePlan(s, split[s], sum(t.numel() for t in local), param_bytes,
                                       param_bytes, optimizer, acts, in_flight, peak))  # fmt: skip
    return plan


def _count_layers(model: nn.Module) -> int:
    return len(model.get_submodule(decoder_layers(model)))


def _part(config, stage: int, pp: int, layers: list[int], mesh, dp_mode: str) -> nn.Module:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if pp > 1:
        model = build_hf_stage(model, stage, pp, layers)
    return parallelize_hf(model, mesh, dp_mode=dp_mode)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _activation_bytes(part: nn.Module, first: bool, last: bool, micro_batch: int, seq: int,
                      config, tp: int) -> int:  # fmt: skip
    """Bytes autograd saves in one microbatch's forward of `part` (distinct tensors), plus the
    loss's fp32 copy of this rank's logits on the last stage."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        local = _local(t)
        seen[id(local)] = local.numel() * local.element_size()
        return t

    b, meta = micro_batch, torch.device("meta")
    mask = torch.ones(b, 1, seq, seq, dtype=torch.bool, device=meta)  # causal: values unread
    if first:
        given = {"input_ids": torch.zeros(b, seq, dtype=torch.long, device=meta)}
    else:
        dtype = next(part.parameters()).dtype
        given = {"inputs_embeds": torch.zeros(b, seq, config.hidden_size, dtype=dtype, device=meta,
                                              requires_grad=True)}  # fmt: skip
    forward = type(part).__mro__[2].forward if getattr(part, "mesh3d_stage", None) else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if last:
            call = forward or type(part).forward
            call(part, **given, attention_mask=mask, use_cache=False)
        else:
            part.base_model(**given, attention_mask=mask, use_cache=False)
    logits = b * seq * (config.vocab_size // tp) * 4 if last else 0
    return sum(seen.values()) + logits


def format_hf_plan(plan: HFPlan) -> str:
    """The plan as a short text table (MiB)."""

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:,.1f}"

    lines = [f"{plan.model}: {plan.total_params:,} parameters; dp {plan.dp} x tp {plan.tp} x "
             f"pp {plan.pp} ({plan.dp_mode}), micro batch {plan.micro_batch} x "
             f"{plan.sequence_length} tokens, {plan.microbatches} microbatches a step",
             "", "| stage | layers | params (local) | params MiB | grads MiB | AdamW MiB | "
             "activations MiB / microbatch | in flight | peak MiB |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in plan.stages:
        span = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "none"
        lines.append(f"| {s.stage} | {span} | {s.params:,} | {mib(s.param_bytes)} | "
                     f"{mib(s.grad_bytes)} | {mib(s.optimizer_bytes)} | "
                     f"{mib(s.activation_bytes)} | {s.in_flight} | {mib(s.peak_bytes)} |")  # fmt: skip
    if plan.note:
        lines.append(f"note: {plan.note}; the peak leaves them out")
    return "\n".join(lines) + "\n"
