"""Any Hugging Face `transformers` causal LM on mesh3d's mesh: its own TP plan, mesh3d's DP.

`transformers` writes a TP plan for most architectures (`model.tp_plan`: the config's
`base_model_tp_plan` under the base model's attribute name, plus the head's own entry), in style
names such as "colwise" and "rowwise". This module translates each name into one of torch's
parallel styles and applies them with `mesh3d.apply_tp`; the model file stays untouched. What a
style means here (a name with no entry below is refused, naming the module):

    colwise                      ColwiseParallel: input replicated, output sharded on features
    rowwise                      RowwiseParallel: input sharded on features, output all-reduced
    colwise_rep / _gather_output ColwiseParallel, output all-gathered
    rowwise_rep / _split_input   RowwiseParallel, replicated input split locally
    embedding_rowwise            vocab-parallel embedding (RowwiseParallel on nn.Embedding)
    replicated_with_grad_allreduce  nothing: the module stays replicated, its inputs too, so
                                 its gradients are already equal on every tp rank
    the LM head (colwise_gather_output in transformers' plan): vocab-parallel, its logits left
    sharded for `mesh3d.normalized_loss` (`vocab_parallel=False`: gathered as transformers does)

Modules no plan names (norms, routers, MoE experts) stay replicated plain parameters; so an
optimizer over the model needs `foreach=False` (mixed plain and DTensor parameters).

Pipeline stages of such a model: `mesh3d/hf_stages.py`.
"""

from __future__ import annotations

import os

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from mesh3d.config.hf_model import from_pretrained
from mesh3d.errors import UserError
from mesh3d.mesh import replica_mesh
from mesh3d.parallel.fsdp import apply_dp
from mesh3d.parallel.tensor import apply_tp

# transformers' style name -> the torch style that does the same on mesh3d's mesh
_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: None,
}
# projections whose output holds attention heads, fused or not (their shards must be whole heads)
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn")


def hf_tp_plan(
    model: nn.Module, tp: int, vocab_parallel: bool = True, names: dict[str, str] | None = None
) -> dict[str, ParallelStyle]:
    """`model`'s own TP plan (or `names`: `{module pattern: transformers style}`) as torch
    parallel styles for `tp` ranks, checked against its sizes without communication: a style
    mesh3d cannot apply, or sizes tp does not divide, raise one `UserError` line naming the
    module (see the module docstring for the styles).

    Example:

        from mesh3d.hf_models import hf_tp_plan
        plan = hf_tp_plan(transformers.OlmoForCausalLM(config), tp=2)
    """
    names = names or getattr(model, "tp_plan", None) or _config_plan(model)
    if not names:
        raise UserError(
            f"tp: {type(model).__name__} has no TP plan (config.base_model_tp_plan is empty); "
            "use tp=1, or pass tp_plan={module pattern: style}"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plan = {}
    for pattern, style in names.items():
        modules = _matches(model, pattern)
        if style not in _STYLES:
            raise UserError(
                f"tp: module {pattern!r} has style {style!r}, which mesh3d cannot apply yet "
                f"(it applies {', '.join(sorted(_STYLES))}); use tp=1 for {type(model).__name__}"
            )
        for name, module in modules:
            _check_divides(model, name, module, style, tp, module is head)
        if head is not None and any(m is head for _, m in modules) and vocab_parallel:
            plan[pattern] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif (made := _STYLES[style]()) is not None:
            plan[pattern] = made
    return plan


def hf_llama_tp_plan() -> dict:
    """A plan for Hugging Face `transformers` `LlamaForCausalLM` (its module names).

    Attention and MLP projections are split Megatron-style (column then row); embeddings, norms
    and the LM head stay replicated (plain parameters: use `foreach=False` in the optimizer).
    Heads are divided over tp, so tp must divide both head counts.

    Example:

        model = transformers.LlamaForCausalLM(config)   # same full weights on every rank
        mesh3d.apply_tp(model, mesh["tp"], mesh3d.hf_llama_tp_plan())
    """
    col, row = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    where = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
             "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
    plan = {f"model.layers.*.{where[n]}.{n}": ColwiseParallel() for n in col}
    plan.update({f"model.layers.*.{where[n]}.{n}": RowwiseParallel() for n in row})
    return plan


def parallelize_hf(
    model: nn.Module | str | os.PathLike,
    mesh: DeviceMesh,
    *,
    tp_plan: str | dict[str, str] = "auto",
    dp_mode: str = "replicate",
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    ep=None,
) -> nn.Module:
    """Put a `transformers` causal LM (the same full weights on every rank; or a local folder or
    hub id, which every rank loads, `load_hf`) on `mesh`'s tp and dp axes, in place: tensor
    parallelism from its own plan (`tp_plan="auto"`, or a dict `{module pattern: transformers
    style name}`), then data parallelism by `dp_mode` ('replicate': sum gradients with
    `mesh3d.allreduce_gradients` after backward; 'zero1' / 'full': FSDP2 over dp, one unit per
    decoder layer, which *averages* gradients: multiply the loss by the dp size). Everything is
    checked before any collective; what cannot be done is refused in one `UserError` line naming
    the axis and the reason. With `vocab_parallel` the logits come back vocab-sharded (a
    DTensor): give them to `mesh3d.normalized_loss`. With `sequence_parallel` (tp > 1, pp = 1)
    the residual stream and the norms are split over tp on the sequence
    (`mesh3d/hf_sequence.py`); the norms' gradients are then `Partial` DTensors
    (`allreduce_gradients` and AdamW handle them). `ep` (a `parallel.experts.ExpertParallel`,
    ep > 1): its stacked MoE experts split over the ep ranks (`mesh3d/hf_experts.py`; their
    gradients sum over the ranks holding the same experts). Returns the model (the loaded one,
    for a folder or hub id).

    Example:

        mesh = mesh3d.build_mesh(mesh3d.ParallelDims(dp=2, tp=2, pp=1), "cpu")
        torch.manual_seed(0)
        model = transformers.GPTNeoXForCausalLM(config)      # same weights on every rank
        mesh3d.parallelize_hf(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        logits = model(input_ids=tokens[:, :-1]).logits
        mesh3d.normalized_loss(logits, tokens[:, 1:], config.vocab_size, global_tokens).backward()
        mesh3d.allreduce_gradients(model, mesh["dp"].get_group())
    """
    model = load_hf(model)
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    if sizes.get("pp", 1) > 1 and getattr(model, "mesh3d_stage", None) is None:
        raise UserError(
            f"pp: pp={sizes['pp']} needs this rank's stage, not the whole "
            f"{type(model).__name__}: pass mesh3d.build_hf_stage(model, ...)"
        )
    cp = sizes.get("cp", 1)
    if cp > 1:  # its attention modules call mesh3d's (`mesh3d/hf_context.py`)
        from mesh3d.hf_context import check_cp

        if sizes.get("pp", 1) > 1:
            raise UserError(f"cp: cp={cp} with pp={sizes['pp']} is not supported for "
                            f"{type(model).__name__} yet; use pp=1 or cp=1")  # fmt: skip
        check_cp(model, cp)
    if dp_mode not in ("replicate", "zero1", "full"):
        raise UserError(f"dp: dp_mode {dp_mode!r} is unknown; use 'replicate', 'zero1' or 'full'")
    if ep is not None and ep.size > 1:  # its stacked experts split (`mesh3d/hf_experts.py`)
        from mesh3d.hf_experts import apply_ep

        apply_ep(model, ep)
    tp = sizes.get("tp", 1)
    if tp > 1:
        given = None if tp_plan == "auto" else tp_plan
        if given is not None and not isinstance(given, dict):
            raise UserError(f"tp: tp_plan {tp_plan!r} is neither 'auto' nor a dict")
        plan = hf_tp_plan(model, tp, vocab_parallel, given)
        if sequence_parallel:
            plan = _with_sequence_parallel(model, plan, sizes.get("pp", 1))
        tied = ties_embeddings(model)
        apply_tp(model, mesh["tp"], plan, strict=False)
        if tied:  # the embedding and the head were parallelized apart: one parameter again
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if cp > 1:
        from mesh3d.hf_context import use_cp
        from mesh3d.parallel.context import ContextParallel

        use_cp(model, ContextParallel(mesh["cp"].get_group(), cp, mesh["cp"].get_local_rank()))
    if sizes.get("dp", 1) * cp > 1 and dp_mode != "replicate":  # cp ranks replicate like dp's
        replicas = replica_mesh(mesh) if cp > 1 else mesh["dp"]
        apply_dp(model, replicas, dp_mode, blocks=decoder_layers(model))
    return model


def _with_sequence_parallel(model: nn.Module, plan: dict, pp: int) -> dict:
    from mesh3d.hf_sequence import sequence_parallel_plan

    if pp > 1:
        raise UserError(
            f"tp: sequence parallelism with pp={pp} is not supported for "
            f"{type(model).__name__} yet; use sequence_parallel=False or pp=1"
        )
    layers = decoder_layers(model)
    order = list(getattr(model, "_pp_plan", None) or {})
    head = model.get_output_embeddings()
    after = order[order.index(layers) + 1 :] if layers in order else []
    norms = [n for n in after if model.get_submodule(n) is not head]
    return sequence_parallel_plan(model, plan, layers, norms)


def load_hf(source: nn.Module | str | os.PathLike) -> nn.Module:
    """`source` itself when it is a model, else the causal LM saved in that local folder (or at
    that hub id, where a network exists), in its saved dtype; a source that cannot be loaded is
    one `UserError` line."""
    if isinstance(source, nn.Module):
        return source
    import transformers

    what = "a transformers causal LM (config.json and weights)"
    return from_pretrained(transformers.AutoModelForCausalLM, source, "model", what)


def load_hf_config(source: str | os.PathLike):
    """The `transformers` config saved in a local folder (or at a hub id, where a network
    exists); one `UserError` line when there is none."""
    import transformers

    return from_pretrained(transformers.AutoConfig, source, "model", "a transformers config.json")


def decoder_layers(model: nn.Module) -> str:
    """The dotted name of `model`'s decoder layers (a ModuleList), from its pipeline plan or
    the base model's `layers`."""
    pp_plan = getattr(model, "_pp_plan", None) or {}
    for name in [*pp_plan, f"{getattr(model, 'base_model_prefix', 'model')}.layers"]:
        try:
            if isinstance(model.get_submodule(name), nn.ModuleList):
                return name
        except AttributeError:
            continue
    raise UserError(
        f"dp: {type(model).__name__} has no ModuleList of decoder layers that "
        "mesh3d can find; use dp_mode='replicate'"
    )


def _config_plan(model: nn.Module) -> dict[str, str]:
    base = (getattr(getattr(model, "config", None), "base_model_tp_plan", None)) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and getattr(model, prefix, None) is not None:
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def _matches(model, pattern: str) -> list[tuple[str, nn.Module]]:
    """The submodules `pattern` names (`*` matching one name)."""
    from fnmatch import fnmatch

    tokens = pattern.split(".")
    return [
        (n, m)
        for n, m in model.named_modules()
        if n and len(n.split(".")) == len(tokens) and all(map(fnmatch, n.split("."), tokens))
    ]


def _check_divides(model, name: str, module: nn.Module, style: str, tp: int, is_head: bool) -> None:
    """Sharded sizes must split evenly; head projections must split into whole heads."""
    if _STYLES[style]() is None:  # stays replicated: nothing is split
        return
    config = model.config
    if isinstance(module, nn.Embedding) or is_head:  # [V, h] weights, split on the vocabulary
        size, what = module.weight.shape[0], "vocabulary size"
        fix = f"pad it: model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of={tp})"
    elif isinstance(module, nn.Linear):
        col = style.startswith("colwise")
        size = module.out_features if col else module.in_features
        what = "output features" if col else "input features"
        fix = "choose a tp that divides it"
    else:
        raise UserError(
            f"tp: module {name!r} ({type(module).__name__}) has style {style!r}, "
            "which mesh3d applies to nn.Linear and nn.Embedding only; use tp=1"
        )
    if size % tp:
        raise UserError(f"tp: {name} has {size} {what}, not divisible by tp={tp}; {fix}")
    if name.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS and style == "colwise":
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if n is not None and n % tp:
                raise UserError(
                    f"tp: {key}={n} of {type(model).__name__} is not divisible by "
                    f"tp={tp} ({name} is split by heads); choose a tp that divides it"
                )


def ties_embeddings(model: nn.Module) -> bool:
    """Whether `model`'s input embedding and LM head share one weight."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return emb is not None and head is not None and head.weight is emb.weight
