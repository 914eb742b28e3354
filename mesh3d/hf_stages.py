"""Pipeline stages of any Hugging Face `transformers` causal LM, cut at its decoder layers.

A stage is a copy of the model without what it does not own (the kept decoder layers keep their
keys, so parameter names are the full model's), run through the model's own forward: a middle
stage calls the base model with `inputs_embeds` (its final norm an identity), the last stage the
causal LM's forward (norm, head, soft-capping and whatever else the architecture does after its
layers). The rotary or other position embeddings are computed on every stage from the positions,
as the model's forward does. The stage's class is a subclass of the model's with the one-tensor
forward `torch.distributed.pipelining` calls. Which modules come before and after the layers is
read from the model's `base_model_pp_plan`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os

from torch import nn

from mesh3d.errors import UserError
from mesh3d.hf_context import positions_of
from mesh3d.hf_models import decoder_layers, load_hf, ties_embeddings
from mesh3d.parallel.pipeline_layout import split_by_cost
from mesh3d.torch_private import child_slots


def build_hf_stage(
    model: nn.Module | str | os.PathLike, stage_id: int, num_stages: int, layers: list[int]
) -> nn.Module:
    """A copy of the `transformers` causal LM `model` holding pipeline stage `stage_id`'s part:
    its decoder `layers` (names as in the full model; may be empty), the embedding on the
    first stage, the final norm and the head on the last (module docstring). Its forward takes
    token ids (first stage) or the previous stage's hidden states and returns hidden states,
    or logits on the last stage. A tied embedding and head on different stages become two
    copies whose gradients `mesh3d.parallel.pipeline.sync_tied_embeddings` sums after each
    backward (mesh3d's run does it). A folder or hub id is loaded first (`load_hf`).

    Example:

        stage = mesh3d.build_hf_stage(model, pp_rank, 2, [[0, 1], [2, 3]][pp_rank])
        mesh3d.parallelize_hf(stage, mesh)    # then a PipelineStage of it, mesh3d.build_schedule
    """
    model = load_hf(model)
    name = type(model).__name__
    tied = num_stages > 1 and ties_embeddings(model)
    where = decoder_layers(model)
    count = len(model.get_submodule(where))
    if any(not 0 <= i < count for i in layers) or sorted(set(layers)) != list(layers):
        raise UserError(
            f"pp: stage {stage_id} layers {layers} must be increasing indices "
            f"of {name}'s {count} decoder layers"
        )
    order = list(getattr(model, "_pp_plan", None) or {})
    if where not in order:
        raise UserError(f"pp: {name} has no base_model_pp_plan naming {where}; use pp=1")
    head = _name_of(model, model.get_output_embeddings())
    embedding = _name_of(model, model.get_input_embeddings())
    before = [n for n in order[: order.index(where)] if n != head]
    after = [n for n in order[order.index(where) + 1 :] if n != head] + [head]
    first, last = stage_id == 0, stage_id == num_stages - 1
    container = model.get_submodule(where)
    dropped = [m for i, m in enumerate(container) if i not in layers]
    dropped += [model.get_submodule(n) for n in before if not first]
    dropped += [model.get_submodule(n) for n in after if not last]
    stage = copy.deepcopy(model, memo={id(m): None for m in dropped})
    kept = stage.get_submodule(where)
    slots = child_slots(kept)
    for key in [k for k, m in slots.items() if m is None]:
        del slots[key]  # the kept keys stay: "layers.2..." on stage 1 as in the model
    for n in before if not first else ():  # embeddings, dropouts: done once, on stage 0
        _set(stage, n, None if n == embedding else nn.Identity())
    for n in after if not last else ():  # the final norm; the head
        _set(stage, n, None if n == head else nn.Identity())
    base = stage.base_model
    if isinstance(getattr(base.config, "layer_types", None), list):  # read by position i
        base.config = copy.copy(base.config)
        base.config.layer_types = [base.config.layer_types[i] for i in layers]
    stage.__class__ = _stage_class(type(model))
    stage.mesh3d_stage, stage.mesh3d_tied = (first, last), tied
    if tied and last and not first:  # the head's own copy, saved under the embedding's name
        stage.tied_parameters = {f"{head}.weight": f"{embedding}.weight"}
    return stage


def hf_stage_layers(model: nn.Module, pp: int) -> list[list[int]]:
    """The decoder layers of each of `pp` stages, split by their parameter counts (Nanotron's
    cost split, the head's parameters counted after the last layer)."""
    layers = model.get_submodule(decoder_layers(model))
    costs = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    head = model.get_output_embeddings()
    return split_by_cost(costs, head.weight.numel() if head is not None else 0, pp)


class _StageForward:
    """Mixed into a stage's class: the pipeline's one-tensor forward, and the ends of a tie."""

    def mesh3d_tied_ends(self):
        """(embedding, head) of a model whose tie the stages split, None where this stage holds
        one not; None otherwise. The pipeline sums their gradients every step
        (`parallel/pipeline.py::sync_tied_embeddings`), so the two copies stay equal."""
        if not self.mesh3d_tied:
            return None
        return self.get_input_embeddings(), self.get_output_embeddings()

    def forward(self, x, positions=None):
        """Token ids or hidden states -> hidden states or logits; `positions`: the global
        positions of the tokens of this cp rank (context parallelism, `hf_context.py`)."""
        first, last = self.mesh3d_stage
        given = {"input_ids": x} if first else {"inputs_embeds": x}
        cp = getattr(self, "mesh3d_cp", None)
        if (positions is None) != (cp is None):
            raise UserError(f"{type(self).__name__}: positions go with context parallelism only")
        scope = contextlib.nullcontext() if cp is None else positions_of(cp, positions)
        with scope:
            if cp is not None:
                given["position_ids"] = positions
            if last:
                return super().forward(**given, use_cache=False).logits
            return self.base_model(**given, use_cache=False).last_hidden_state


@functools.cache
def _stage_class(cls: type) -> type:
    return type(f"{cls.__name__}Stage", (_StageForward, cls), {})


def _set(model: nn.Module, dotted: str, value) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, value)


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)
