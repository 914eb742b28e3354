"""Mamba's spec (the model is `models/mamba.py`): Nanotron's names, the TP plan, the config
checks, the init, costs and FLOPs, and HF `MambaForCausalLM` both ways.

Nanotron (examples/mamba/mamba.py): decoder layer `i` holds `mixer` (its own `A_log` and `D`,
then `in_proj`, `conv1d`, `x_proj`, `dt_proj`, `out_proj`) and `norm`; the embedding is tied to
the head. Over tp, `in_proj` is column-parallel on its interleaved x/z rows, `x_proj` and
`out_proj` row-parallel, and `conv1d`, `dt_proj`, `A_log`, `D` split on their channels (dim 0):
the scan runs per channel, so a rank scans its channels alone; x_proj's dt, B, C are summed
over tp. Context parallelism would split the scan's sequence and is refused.

Hugging Face `MambaForCausalLM` (the `state-spaces/mamba-*-hf` checkpoints): names under
`backbone.` (`embeddings`, `layers.{i}.norm`, `layers.{i}.mixer.*`, `norm_f`), `in_proj`'s rows
x then z (ours interleave them: `weights_to_hf` / `weights_from_hf`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from mesh3d.config.mamba import MambaConfig, MambaInit, MambaSSMConfig
from mesh3d.config.schema import SFTDatasetsArgs
from mesh3d.errors import not_divisible
from mesh3d.models.llama_checks import MC
from mesh3d.models.spec import Blocks, HFSpec, LayerTable, ModelShape, ModelSpec
from mesh3d.nanotron_names import EMBEDDING, FINAL_NORM, LM_HEAD

# Nanotron's parameter order in a decoder layer (its optimizer files keep it)
NANOTRON_LAYER: LayerTable = {
    f"mixer.{n}": ((f"mixer.{n}",), kind)
    for n, kind in (("A_log", "column"), ("D", "column"), ("in_proj.weight", "column"),
                    ("conv1d.weight", "column"), ("conv1d.bias", "column"),
                    ("x_proj.weight", "row"), ("dt_proj.weight", "column"),
                    ("dt_proj.bias", "column"), ("out_proj.weight", "row"))
} | {"norm.weight": (("norm.weight",), "replicated")}  # fmt: skip
NANOTRON_OUTER = {
    EMBEDDING: (("embed_tokens.weight",), "vocab", "first"),
    FINAL_NORM: (("norm.weight",), "replicated", "last"),
    LM_HEAD: (("lm_head.weight",), "vocab", "last"),  # tied: never written
}
CHANNELS = ("A_log", "D", "conv1d.weight", "conv1d.bias")  # read by the mixer itself


def ssm_of(mc) -> MambaSSMConfig:
    return mc.ssm_cfg or MambaSSMConfig()


def shape(mc, padded_vocab: int) -> ModelShape:
    from mesh3d.models.mamba import ssm_sizes

    d_inner, d_state, d_conv, dt_rank = ssm_sizes(mc)
    return ModelShape(
        num_layers=mc.num_hidden_layers, hidden_size=mc.d_model, intermediate_size=d_inner,
        num_heads=1, num_kv_heads=1, padded_vocab=padded_vocab, tied=True, family="mamba",
        d_state=d_state, d_conv=d_conv, dt_rank=dt_rank, conv_bias=ssm_of(mc).conv_bias,
    )  # fmt: skip


def build(mc, vocab_size: int | None = None, attention: str = "auto"):
    from mesh3d.models.mamba import Mamba

    return Mamba(mc, vocab_size=vocab_size, attention=attention)


def tp_plan(sequence_parallel: bool, shape: ModelShape | None = None) -> dict:
    """in_proj and dt_proj column-wise, x_proj row-wise summed to every rank (its gradient
    summed back), out_proj row-wise, the mixer's own channel tensors split on dim 0; norms
    replicated, a vocab-parallel embedding and head (as Llama's plan)."""
    from mesh3d.tp_family_styles import LocalChannels, LocalRowwiseShared
    from mesh3d.tp_styles import (
        LocalColwise,
        LocalEmbedding,
        LocalHead,
        LocalReplicated,
        LocalRowwise,
        Replicate,
        Shard,
    )

    act = Shard(1) if sequence_parallel else Replicate()
    layer = {
        "norm": LocalReplicated(partial_grads=sequence_parallel),
        "mixer": LocalChannels(act, CHANNELS),
        "mixer.in_proj": LocalColwise(),
        "mixer.x_proj": LocalRowwiseShared(),
        "mixer.dt_proj": LocalColwise(),
        "mixer.out_proj": LocalRowwise(output_layouts=act),
    }
    return {
        "embed_tokens": LocalEmbedding(input_layouts=Replicate(), output_layouts=act),
        **{f"layers.*.{k}": v for k, v in layer.items()},
        "norm": LocalReplicated(partial_grads=sequence_parallel),
        "lm_head": LocalHead(act),
    }


def compile_classes(tensor_parallel: bool) -> tuple[type, ...]:
    """The norms; the mixer stays eager (its scan loops over the sequence)."""
    from mesh3d.models.llama import RMSNorm

    return () if tensor_parallel else (RMSNorm,)


def blocks() -> Blocks:
    return Blocks(attention=())


def nanotron_layer(s: ModelShape, i: int = 0) -> LayerTable:
    if s.conv_bias:
        return NANOTRON_LAYER
    return {k: v for k, v in NANOTRON_LAYER.items() if k != "mixer.conv1d.bias"}


def param_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    h, d, n = s.hidden_size, s.intermediate_size, s.d_state
    layer = {
        "norm.weight": (h,), "mixer.A_log": (d, n), "mixer.D": (d,),
        "mixer.in_proj.weight": (2 * d, h), "mixer.conv1d.weight": (d, 1, s.d_conv),
        "mixer.x_proj.weight": (s.dt_rank + 2 * n, d), "mixer.dt_proj.weight": (d, s.dt_rank),
        "mixer.dt_proj.bias": (d,), "mixer.out_proj.weight": (h, d),
    }  # fmt: skip
    if s.conv_bias:
        layer["mixer.conv1d.bias"] = (d,)
    shapes = {"embed_tokens.weight": (s.padded_vocab, h), "norm.weight": (h,),
              "lm_head.weight": (s.padded_vocab, h)}  # fmt: skip
    for i in range(s.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def init_for(mc):
    """`init_std` with `mc`'s ssm_cfg: Nanotron's example's init (its `init_model_randomly`).
    Linears (in_proj, x_proj, out_proj) and conv1d: PyTorch's default, uniform ±1/sqrt(fan_in);
    out_proj then divided by sqrt(layers) with scaling NUM_LAYERS (`rescale_prenorm_residual`);
    dt_proj.weight uniform ±dt_scale/sqrt(dt_rank) (or that constant); the embedding N(0, std);
    norms and D ones; A_log = log(1..d_state) on every channel. dt_proj.bias is the inverse
    softplus of a dt drawn log-uniform in [dt_min, dt_max] (floored at dt_init_floor), as the
    example's mixer and HF build it (the example's init afterwards overwrites it with a
    default linear bias, which leaves dt_min / dt_max without effect; mesh3d keeps them)."""
    import torch

    ssm = ssm_of(mc)

    def uniform(bound: float):
        return lambda shape, gen: torch.empty(shape).uniform_(-bound, bound, generator=gen)

    def dt_bias(shape, gen):
        lo, hi = math.log(ssm.dt_min), math.log(ssm.dt_max)
        dt = torch.exp(torch.rand(shape, generator=gen) * (hi - lo) + lo).clamp(
            min=ssm.dt_init_floor
        )
        return dt + torch.log(-torch.expm1(-dt))

    def a_log(shape, gen):
        return torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float32)).expand(shape).clone()

    def init_std(name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"):
        leaf = name.split(".mixer.")[-1]
        if name.endswith(("norm.weight", "mixer.D")):
            return None
        if leaf == "A_log":
            return a_log
        if leaf == "dt_proj.bias":
            return dt_bias
        if leaf == "dt_proj.weight":
            bound = ssm.dt_scale * (shape(mc, 1).dt_rank ** -0.5)
            return (
                (lambda s, g: torch.full(s, bound)) if ssm.dt_init == "constant" else uniform(bound)
            )
        if leaf == "conv1d.bias":
            return uniform(1 / math.sqrt(ssm.d_conv))
        if leaf in ("in_proj.weight", "x_proj.weight", "out_proj.weight", "conv1d.weight"):
            rescale = leaf == "out_proj.weight" and scaling_method == "NUM_LAYERS"
            div = math.sqrt(num_layers) if rescale else 1.0

            return lambda s, g: uniform(1 / math.sqrt(math.prod(s[1:])) / div)(s, g)
        return std  # embed_tokens (and the tied lm_head)

    return init_std


def init_std(name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"):
    """`init_for` at the default ssm_cfg (a run uses `init_for` with its own)."""
    return init_for(MambaConfig())(name, std, num_layers, scaling_method)


def step_flops(s: ModelShape, seq_len: int, batch_size: int) -> float:
    """Nanotron's example's model FLOPs (`get_flops_per_sec`): per layer in_proj, x_proj,
    dt_proj, out_proj and 9·S·N·h for the scan; the head; backward twice the forward."""
    S, h, d, n, r = seq_len, s.hidden_size, s.intermediate_size, s.d_state, s.dt_rank
    layer = 4 * S * h * d + 2 * S * d * (r + 2 * n) + 2 * S * r * d + 2 * S * d * h + 9 * S * n * h
    forward = s.num_layers * layer + 2 * S * s.padded_vocab * h
    return 3.0 * forward * batch_size


def pipeline_costs(s: ModelShape) -> tuple[list[int], int]:
    """Nanotron's example's block costs: 1 per decoder layer, 0 for the head."""
    return [1] * s.num_layers, 0


def config_sizes(mc) -> dict[str, int]:
    ssm = ssm_of(mc)
    sizes = {f"{MC}.{k}": getattr(mc, k) for k in ("d_model", "num_hidden_layers", "vocab_size")}
    sizes.update({f"{MC}.ssm_cfg.{k}": getattr(ssm, k) for k in ("d_state", "d_conv", "expand")})
    if isinstance(ssm.dt_rank, int):  # a string other than "auto": `config_errors` says so
        sizes[f"{MC}.ssm_cfg.dt_rank"] = ssm.dt_rank
    return sizes


def config_errors(cfg) -> Iterator[str]:
    """The mixer's channels against tp, ssm_cfg's values, what mesh3d's Mamba does not hold."""
    mc, p = cfg.model.model_config, cfg.parallelism
    ssm, key = ssm_of(mc), f"{MC}.ssm_cfg"
    if isinstance(ssm.dt_rank, str) and ssm.dt_rank != "auto":
        yield f'`{key}.dt_rank` must be "auto" or an int >= 1, got {ssm.dt_rank!r}'
    if ssm.dt_init not in ("random", "constant"):
        yield f"`{key}.dt_init` {ssm.dt_init!r} is not one of random, constant"
    if not 0 < ssm.dt_min <= ssm.dt_max:
        yield f"`{key}.dt_min` ({ssm.dt_min}) and dt_max ({ssm.dt_max}) need 0 < dt_min <= dt_max"
    if ssm.dt_init_floor < 0:
        yield f"`{key}.dt_init_floor` must be >= 0, got {ssm.dt_init_floor}"
    if ssm.bias:
        yield (f"`{key}.bias` is true, but Nanotron's Mamba builds in_proj and out_proj without "
               "biases whatever it says; set it to false")  # fmt: skip
    if not mc.rms_norm:
        yield (f"`{MC}.rms_norm: false` (LayerNorm blocks) is not supported by mesh3d yet; "
               "set it to true (HF MambaForCausalLM and the state-spaces checkpoints use RMSNorm)")  # fmt: skip
    if not mc.rms_norm_eps > 0:
        yield f"`{MC}.rms_norm_eps` must be > 0, got {mc.rms_norm_eps}"
    if isinstance(ssm.expand, int) and isinstance(mc.d_model, int):
        yield from not_divisible(f"{key}.expand x {MC}.d_model", ssm.expand * mc.d_model,
                                 "parallelism.tp", p.tp,
                                 "each tp rank scans a whole share of the channels; choose a "
                                 "parallelism.tp that divides it")  # fmt: skip
    if p.context_parallel_size > 1:
        yield ("`parallelism.context_parallel_size` must be 1 for Mamba (the scan runs over the "
               "whole sequence; context parallelism would split it); set it to 1")  # fmt: skip
    sft = any(isinstance(st.data.dataset, SFTDatasetsArgs) for st in cfg.data_stages or [])
    if sft and cfg.mesh3d.sft_packing:
        yield ("`mesh3d.sft_packing` is true, but Mamba's scan cannot restart inside a row (packed "
               "examples would read each other's state); set it to false for a Mamba SFT run")  # fmt: skip
    fp32_grads = cfg.optimizer is not None and cfg.optimizer.accumulate_grad_in_fp32
    if p.pp > 1 and mc.residual_in_fp32 and cfg.model.dtype != "float32" and not fp32_grads:
        yield (f"`{MC}.residual_in_fp32` with pp {p.pp} and {cfg.model.dtype} weights: the stages "
               "would send an fp32 residual where they expect the weights' dtype; set "
               "optimizer.accumulate_grad_in_fp32 to true (fp32 weights, autocast) or "
               "residual_in_fp32 to false")  # fmt: skip
    init = cfg.model.init_method
    if isinstance(init, MambaInit) and init.n_residuals_per_layer != 1:
        yield (f"`model.init_method.n_residuals_per_layer` is {init.n_residuals_per_layer}, but a "
               "Mamba-1 layer has one residual branch (no MLP); set it to 1")  # fmt: skip


# ------------------------------------------------------------------------- Hugging Face

HF = "MambaForCausalLM"


def ours_to_hf(name: str) -> str:
    if name == "lm_head.weight":
        return name
    if name == "embed_tokens.weight":
        return "backbone.embeddings.weight"
    if name == "norm.weight":
        return "backbone.norm_f.weight"
    return "backbone." + name


def hf_to_ours(name: str) -> str | None:
    if name in ("backbone.embeddings.weight", "backbone.embedding.weight"):
        return "embed_tokens.weight"
    if name == "backbone.norm_f.weight":
        return "norm.weight"
    return name.removeprefix("backbone.")


def _in_proj(i: int) -> str:
    return f"backbone.layers.{i}.mixer.in_proj.weight"


def weights_to_hf(weights: dict, mc) -> dict:
    """in_proj's interleaved rows (x0, z0, x1, ...) as HF's x rows then z rows."""
    out = dict(weights)
    for i in range(mc.num_hidden_layers):
        w = out[_in_proj(i)]
        out[_in_proj(i)] = w.view(-1, 2, w.shape[-1]).transpose(0, 1).reshape(w.shape).contiguous()
    return out


def weights_from_hf(weights: dict, mc) -> dict:
    """HF's in_proj rows (x then z) interleaved as ours (the reverse of `weights_to_hf`)."""
    out = dict(weights)
    for i in range(mc.num_hidden_layers):
        w = out.get(_in_proj(i))
        if w is not None:
            out[_in_proj(i)] = (
                w.view(2, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape).contiguous()
            )
    return out


def config_from_hf(hf: dict, where) -> MambaConfig:
    from mesh3d.models.hf_fields import refuse

    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in hf]
    if missing:
        refuse(where, f"a config.json without {missing}")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(where, f"hidden_act {hf['hidden_act']!r} (Nanotron's Mamba uses silu)")
    if hf.get("use_bias", False):
        refuse(where, "`use_bias: true` (Nanotron's Mamba has no in_proj / out_proj biases)")
    if not hf.get("tie_word_embeddings", True):
        refuse(where, "`tie_word_embeddings: false` (Nanotron's Mamba ties them)")
    h, expand = hf["hidden_size"], hf.get("expand", 2)
    if hf.get("intermediate_size", expand * h) != expand * h:
        refuse(where, f"intermediate_size {hf['intermediate_size']} other than expand x "
                      f"hidden_size ({expand * h})")  # fmt: skip
    rank = hf.get("time_step_rank", "auto")
    ssm = MambaSSMConfig(
        d_state=hf.get("state_size", 16), d_conv=hf.get("conv_kernel", 4), expand=expand,
        dt_rank="auto" if rank in ("auto", math.ceil(h / 16)) else int(rank),
        dt_min=hf.get("time_step_min", 0.001), dt_max=hf.get("time_step_max", 0.1),
        dt_init=hf.get("time_step_init_scheme", "random"),
        dt_scale=hf.get("time_step_scale", 1.0), dt_init_floor=hf.get("time_step_floor", 1e-4),
        conv_bias=hf.get("use_conv_bias", True), bias=False,
    )  # fmt: skip
    return MambaConfig(
        d_model=h, num_hidden_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        ssm_cfg=ssm, residual_in_fp32=hf.get("residual_in_fp32", True),
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), pad_token_id=hf.get("pad_token_id"),
    )  # fmt: skip


def config_to_hf(mc, dtype: str) -> dict:
    from mesh3d.models.mamba import ssm_sizes

    ssm = ssm_of(mc)
    d_inner, d_state, d_conv, dt_rank = ssm_sizes(mc)
    return {
        "architectures": [HF], "model_type": "mamba", "vocab_size": mc.vocab_size,
        "hidden_size": mc.d_model, "intermediate_size": d_inner, "expand": ssm.expand,
        "num_hidden_layers": mc.num_hidden_layers, "state_size": d_state, "conv_kernel": d_conv,
        "time_step_rank": dt_rank, "time_step_min": ssm.dt_min, "time_step_max": ssm.dt_max,
        "time_step_scale": ssm.dt_scale, "time_step_floor": ssm.dt_init_floor,
        "time_step_init_scheme": ssm.dt_init, "use_conv_bias": ssm.conv_bias, "use_bias": False,
        "hidden_act": "silu", "layer_norm_epsilon": mc.rms_norm_eps,
        "residual_in_fp32": mc.residual_in_fp32, "rescale_prenorm_residual": False,
        "pad_token_id": mc.pad_token_id, "bos_token_id": 0, "eos_token_id": 0,
        "tie_word_embeddings": True, "use_cache": True, "use_mambapy": False,
        "torch_dtype": dtype, "dtype": dtype,
    }  # fmt: skip


HF_SPEC = HFSpec((HF,), "mamba", config_from_hf, config_to_hf, ours_to_hf, hf_to_ours,
                 weights_to_hf, weights_from_hf)  # fmt: skip

MAMBA = ModelSpec(
    family="mamba",
    config_class=MambaConfig,
    shape=shape,
    build=build,
    tp_plan=tp_plan,
    compile_classes=compile_classes,
    blocks=blocks,
    config_sizes=config_sizes,
    config_errors=config_errors,
    nanotron_layer=nanotron_layer,
    nanotron_outer=NANOTRON_OUTER,
    param_shapes=param_shapes,
    init_std=init_std,
    init_for=init_for,
    step_flops=step_flops,
    pipeline_costs=pipeline_costs,
    hf=(HF_SPEC,),
    llama_activations=False,  # no attention or MLP: `mesh3d plan` estimates its activations
    lora=False,  # x_proj's own row-parallel style, in_proj's interleaved rows: not yet
)
