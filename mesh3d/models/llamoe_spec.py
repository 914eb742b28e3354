"""LlaMoE's spec (the model is `models/llamoe.py`; the config `config/llamoe.py`): Nanotron's
examples/moe as a family. Torch-free at import.

Nanotron's names (its `llamoe.py` and `moe.py`): Llama's attention under `attn` and the norms as
in Llama, the MoE under `block_sparse_moe`: the router `gate.layer.weight` [E, h] (a plain
linear, one file without a rank suffix), the experts `experts.mlp.w1.module.weight` and
`experts.mlp.w2.module.weight`, both [E·F, h] with expert e's rows at e·F, split on dim 0 over
tp like a column-parallel weight (one chunk). Those are the files of the example's `SparseMLP`
at expert_parallel_size 1 and tp > 1; the example differs elsewhere (docs/model-families.md):
at tp 1 it keeps w1 transposed in memory, and with one expert per ep rank it builds another
module (`MLP`, w2 [h, F]); mesh3d refuses a one-expert model and writes the tp > 1 form.

No Hugging Face class exists for LlaMoE: there is no conversion.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from mesh3d.config.llamoe import LlaMoEConfig
from mesh3d.errors import ConfigError
from mesh3d.models import llama_spec, moe_spec, qwen2_spec
from mesh3d.models.llama_checks import MC, llama_errors, llama_sizes
from mesh3d.models.spec import LayerTable, ModelShape

MOE = "block_sparse_moe."
LAYER: LayerTable = {  # in the order of the example's decoder layer
    **{k: v for k, v in llama_spec.NANOTRON_LAYER.items() if not k.startswith("mlp.")},
    MOE + "gate.layer.weight": (("mlp.gate.weight",), "replicated"),
    MOE + "experts.mlp.w1.module.weight": (("mlp.experts.w1",), "column"),
    MOE + "experts.mlp.w2.module.weight": (("mlp.experts.w2",), "column"),
}


def shape(mc, padded_vocab: int) -> ModelShape:
    base = llama_spec.shape(mc, padded_vocab)
    return dataclasses.replace(
        base, family="llamoe", moe_layers=tuple(range(mc.num_hidden_layers)),
        num_experts=mc.moe_num_experts, top_k=mc.num_experts_per_tok,
        moe_ffn=mc.intermediate_size,
    )  # fmt: skip


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.llamoe import LlaMoE

    return LlaMoE(mc, vocab_size=vocab_size, attention=attention)


def compile_classes(tensor_parallel: bool) -> tuple[type, ...]:
    """Attention (and the norms without tp); the MoE block's shapes depend on the routing."""
    from mesh3d.models.llama import Attention, RMSNorm

    return (Attention,) if tensor_parallel else (Attention, RMSNorm)


def config_sizes(mc) -> dict[str, int]:
    keys = ("moe_num_experts", "num_experts_per_tok")
    return {**llama_sizes(mc), **{f"{MC}.{k}": getattr(mc, k) for k in keys}}


def config_errors(cfg) -> Iterator[str]:
    """Llama's, less the position limit (the example's rotary table grows past
    max_position_embeddings, its config_llamoe.yaml trains 256 tokens at 128; mesh3d's rotary
    has no table), plus what the example's model cannot be."""
    limit = f"`{MC}.max_position_embeddings` ("
    yield from (e for e in llama_errors(cfg) if not e.startswith(limit))
    mc = cfg.model.model_config
    if mc.rope_scaling is not None:
        yield f"`{MC}.rope_scaling` must be null: Nanotron's LlaMoE has no RoPE scaling"
    if mc.moe_num_experts == 1:
        yield (f"`{MC}.moe_num_experts` is 1: Nanotron's example builds one expert as another "
               "module with another checkpoint layout; use 2 or more (or a Llama model_config)")  # fmt: skip


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    return LAYER


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    shapes = llama_spec.param_shapes(s)
    h, e, f = s.hidden_size, s.num_experts, s.moe_ffn
    for i in range(s.num_layers):
        for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
            del shapes[f"layers.{i}.mlp.{name}"]
        shapes[f"layers.{i}.mlp.gate.weight"] = (e, h)
        shapes[f"layers.{i}.mlp.experts.w1"] = (e * f, h)
        shapes[f"layers.{i}.mlp.experts.w2"] = (e * f, h)
    return shapes


def init_std(name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"):
    """The example's `init_model_randomly`: Llama's rule for attention, norms, embedding and
    head; the router and the experts are plain `nn.Linear`s there, so PyTorch's default:
    uniform ±1/sqrt(h) (their fan-in is h)."""
    if name.endswith(("mlp.gate.weight", "mlp.experts.w1", "mlp.experts.w2")):
        import torch

        def uniform(shape, gen):
            bound = 1 / math.sqrt(shape[-1])
            return torch.empty(shape).uniform_(-bound, bound, generator=gen)

        return uniform
    return llama_spec.init_std(name, std, num_layers, scaling_method)


def step_flops(s: ModelShape, seq_len: int, batch_size: int) -> float:
    """Llama's model FLOPs with each layer's MLP counted as what a token runs: the router and
    its top-k experts (two matrices each), not a gated MLP."""
    flops = llama_spec.step_flops(s, seq_len, batch_size)
    tokens, h = batch_size * seq_len, s.hidden_size
    dense = 6 * tokens * h * s.intermediate_size
    routed = 4 * tokens * h * s.top_k * s.moe_ffn + 2 * tokens * h * s.num_experts
    return flops + 3.0 * s.num_layers * (routed - dense)


def hf_for(mc):
    raise ConfigError(
        "no Hugging Face class exists for LlaMoE (Nanotron's examples/moe): mesh3d has no "
        "conversion for it; keep its Nanotron checkpoints"
    )


LLAMOE = dataclasses.replace(  # Llama's attention, outer names and pipeline costs
    llama_spec.LLAMA,
    family="llamoe",
    config_class=LlaMoEConfig,
    shape=shape,
    build=build,
    tp_plan=qwen2_spec.tp_plan,  # its MoE layers' style: experts replicated over tp
    compile_classes=compile_classes,
    blocks=moe_spec.blocks_with_moe,
    config_sizes=config_sizes,
    config_errors=config_errors,
    nanotron_layer=nanotron_layer,
    param_shapes=param_shapes,
    init_std=init_std,
    step_flops=step_flops,
    hf=(),
    hf_for=hf_for,
    mup=False,
    llama_activations=False,
    lora=False,
)
