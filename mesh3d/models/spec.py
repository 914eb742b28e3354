"""What mesh3d needs to know of a model family beside its model (`models/<family>.py`): the spec.

`parallel/`, `checkpoint/`, `train/` and `plan/` take the spec and import no model. The spec
files import no torch at module level, so `checks/validate.py` can use them before anything starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mesh3d.nanotron_names import Kind

if TYPE_CHECKING:
    from torch import nn

# Nanotron name suffix inside a decoder layer -> (our tensor names it fuses, TP kind)
LayerTable = dict[str, tuple[tuple[str, ...], Kind]]


@dataclass(frozen=True)
class ModelShape:
    """The sizes and switches that fix every parameter's name, shape and pipeline rank.

    Example:

        shape = mesh3d.model_shape(cfg)    # models/registry.py
        shape.head_dim, shape.family
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    padded_vocab: int
    tied: bool
    family: str = "llama"
    head_dim: int = 0  # 0: hidden_size / num_heads (set in __post_init__)
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2's attention_bias)
    qk_norm: bool = False  # RMSNorm of q and k per head (Qwen3)
    multi_query: bool = False  # one key/value head every tp rank holds whole (Starcoder2's MQA)
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0  # each expert's intermediate size
    shared_ffn: int = 0  # the shared expert's intermediate size, 0 without one
    d_state: int = 0  # a state-space mixer's state size per channel (Mamba), 0 without one
    d_conv: int = 0  # its causal convolution's width
    dt_rank: int = 0  # its dt projection's rank
    conv_bias: bool = False  # its convolution has a bias

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)


def decoder_cost(hidden_size: int, ffn_size: int, num_heads: int, head_dim: int) -> int:
    """Nanotron's pipeline cost of one decoder layer (every family it has): 4·nq·dh·h + 3·F·h."""
    return 4 * num_heads * head_dim * hidden_size + 3 * ffn_size * hidden_size


@dataclass(frozen=True)
class Blocks:
    """The module classes parallel and training code find by type, so they import no model:
    attention modules get the cp group, mixture-of-experts blocks the ep group."""

    attention: tuple[type, ...]
    moe: tuple[type, ...] = ()


@dataclass(frozen=True)
class HFSpec:
    """How a family maps to Hugging Face transformers."""

    architectures: tuple[str, ...]  # `architectures` in config.json, the first one written
    model_type: str
    config_from_hf: Callable[[dict, Any], Any]  # (config.json, its path) -> our model config
    config_to_hf: Callable[[Any, str], dict]  # (model config, dtype name) -> config.json
    ours_to_hf: Callable[[str], str]  # our parameter name -> HF's
    hf_to_ours: Callable[[str], str | None]  # HF's -> ours (None: not a weight, e.g. a cache)
    # (HF-named weights, model config) -> the weights HF expects (e.g. zero biases it always has)
    weights_to_hf: Callable[[dict, Any], dict] | None = None
    # the reverse: an HF folder's weights -> the tensors `hf_to_ours` names one by one
    weights_from_hf: Callable[[dict, Any], dict] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """One model family (see the module doc). Callables that need torch import it when called."""

    family: str  # "llama", "qwen2", "qwen3": in messages and README
    config_class: type  # its config dataclass (mesh3d.config.schema, other_families)
    shape: Callable[[Any, int], ModelShape]  # (model config, padded vocab) -> ModelShape
    build: Callable[..., Any]  # (model config, vocab_size, attention) -> the nn.Module
    tp_plan: Callable[..., dict]  # (sequence_parallel, shape=None) -> {FQN pattern: ParallelStyle}
    compile_classes: Callable[[bool], tuple[type, ...]]  # tp > 1 -> classes compiled per layer
    blocks: Callable[[], Blocks]  # the classes parallel and training code act on
    config_sizes: Callable[[Any], dict[str, int]]  # model config -> {dotted key: size >= 1}
    config_errors: Callable[[Any], Iterator[str]]  # Config -> a message per model-config problem
    nanotron_layer: Callable[..., LayerTable]  # (shape, layer index=0) -> that layer's table
    nanotron_outer: dict[str, tuple[tuple[str, ...], Kind, Literal["first", "last"]]]
    param_shapes: Callable[[ModelShape], dict[str, tuple[int, ...]]]  # our name -> full shape
    # (name, std, layers, scaling) -> std (None: ones), or a function (shape, generator) -> tensor
    init_std: Callable[[str, float, int, str], Any]
    step_flops: Callable[[ModelShape, int, int], float]  # (shape, seq len, global batch)
    pipeline_costs: Callable[[ModelShape], tuple[list[int], int]]  # (per-layer, lm_head)
    hf: tuple[HFSpec, ...]  # the HF architectures the family converts to and from
    hf_for: Callable[[Any], HFSpec] = lambda mc: None  # which of them a model config becomes
    mup: bool = False  # spectral µP applies (`models/mup.py`: Nanotron defines it for Llama, Qwen2)
    # (model config) -> whether forward takes `token_keys` [B, S] for dropout (`models/dropout.py`)
    dropout: Callable[[Any], bool] = lambda mc: False
    llama_activations: bool = True  # plan/activations.py's table fits; else `mesh3d plan` estimates
    lora: bool = True  # `mesh3d.lora` adapters apply (`models/lora.py`)
    # (model config) -> `init_std` with the config's own init settings (Mamba's ssm_cfg)
    init_for: Callable[[Any], Callable[[str, float, int, str], Any]] | None = None

    def hf_of(self, model_config) -> HFSpec:
        """The HF architecture `model_config` converts to (the first, unless `hf_for` says)."""
        return self.hf_for(model_config) or self.hf[0]


def tied_ends(m: nn.Module) -> tuple[nn.Module | None, nn.Module | None] | None:
    """A tied model's stage: (its embedding, its head), None where it lacks one; None for an
    untied model."""
    if hasattr(m, "mesh3d_tied_ends"):
        return m.mesh3d_tied_ends()
    return (m.embed_tokens, m.lm_head) if getattr(m, "tie_word_embeddings", False) else None
