"""Sequence parallelism for a `transformers` causal LM under its own TP plan.

Between blocks the residual stream is a DTensor sharded on the sequence (`Shard(1)`) with the
global shape, so the model's own code that reads `inputs_embeds.shape[1]` (positions, masks)
sees the whole sequence. Every norm of a decoder layer, and the final norm, runs on this rank's
rows (`SequenceParallel`). A block of the layer that holds planned projections (attention, a
dense MLP) gets one local copy of the full activations (all-gathered; torch's column-wise styles
all-reduce its input gradient), and its row-wise projections reduce-scatter onto the sequence.
A block with parameters and no planned projection (a MoE block the plan leaves replicated)
gets the full activations too, computes them on every rank, and keeps its rows. The vocab-
parallel embedding reduce-scatters onto the sequence; the head all-gathers it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from mesh3d.errors import UserError

SEQ = Shard(1)  # activations are [B, S, h]


class _FullInput(ParallelStyle):
    """The block's input (first positional or `hidden_states`) as a local copy of the full
    activations, its gradient already whole on every rank (torch's column-wise styles
    all-reduce their input gradient; a block computed on every rank has it whole): the way back
    keeps this rank's rows, no communication. With `keep_rows`, the block's output (or the
    first of a tuple), full on every rank, is handed on as this rank's rows."""

    def __init__(self, keep_rows: bool):
        super().__init__()
        self.keep_rows = keep_rows

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def full(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [SEQ], run_check=False)
            return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Replicate()])

        def pre(_mod, args, kwargs):
            if args:
                return (full(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": full(kwargs["hidden_states"])}

        def post(_mod, _args, out):
            first = out[0] if isinstance(out, tuple) else out
            rows = DTensor.from_local(first, mesh, [Replicate()], run_check=False)
            rows = rows.redistribute(mesh, [SEQ])
            return (rows, *out[1:]) if isinstance(out, tuple) else rows

        module.register_forward_pre_hook(pre, with_kwargs=True)
        if self.keep_rows:
            module.register_forward_hook(post)
        return module


def sequence_parallel_plan(
    model: nn.Module, plan: dict[str, ParallelStyle], layers: str, final_norms: list[str]
) -> dict[str, ParallelStyle]:
    """`plan` (the model's TP plan as torch styles) with sequence parallelism added; `layers`:
    the decoder layers' dotted name, `final_norms`: the modules after them (their pipeline
    plan). What cannot run sequence-parallel is one `UserError` line."""
    name = type(model).__name__
    embedding = model.get_input_embeddings()
    out = {}
    for pattern, style in plan.items():
        if any(m is embedding for _, m in _named(model, pattern)):
            out[pattern] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=SEQ, use_local_output=False
            )
        elif isinstance(style, RowwiseParallel):
            out[pattern] = RowwiseParallel(output_layouts=SEQ, use_local_output=False)
        elif isinstance(style, ColwiseParallel) and not style.use_local_output:  # the head
            out[pattern] = ColwiseParallel(
                input_layouts=SEQ, output_layouts=Shard(-1), use_local_output=False
            )
        else:
            out[pattern] = style
    if not any(m is embedding for p in plan for _, m in _named(model, p)):
        raise UserError(f"tp: sequence parallelism needs {name}'s embedding in its TP plan "
                        "(embedding_rowwise); use sequence_parallel=False")  # fmt: skip
    container = model.get_submodule(layers)
    one = next(iter(container), None)
    planned = [p for p in out if p.startswith(f"{layers}.*.")]
    for child, module in one.named_children() if one is not None else ():
        key = f"{layers}.*.{child}"
        if "norm" in type(module).__name__.lower():
            out[key] = SequenceParallel()
        elif any(p.startswith(f"{key}.") for p in planned):
            out[key] = _FullInput(keep_rows=False)
        elif isinstance(module, nn.Dropout):
            if module.p:
                raise UserError(f"tp: {name}'s {child} drops out {module.p} of the sequence "
                                "shards, which DTensor cannot draw on CPU meshes; set it to 0 "
                                "or use sequence_parallel=False")  # fmt: skip
        elif next(module.parameters(), None) is not None:
            out[key] = _FullInput(keep_rows=True)
    for norm in final_norms:
        out[norm] = SequenceParallel()
    return out


def _named(model: nn.Module, pattern: str):
    return [(n, m) for n, m in model.named_modules() if n and _fits(n, pattern)]


def _fits(name: str, pattern: str) -> bool:
    from fnmatch import fnmatch

    parts, tokens = name.split("."), pattern.split(".")
    return len(parts) == len(tokens) and all(map(fnmatch, parts, tokens))
