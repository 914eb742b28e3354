"""Nanotron's examples/mamba config classes: the model config (`is_mamba_config`), its
`ssm_cfg` and its init method. Outside `schema.py`: the config pickers of `load.py` import this
module when a YAML has a Mamba model config or init, so a run of another family never loads it
(`ModelArgs.model_config` / `init_method` then hold these classes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MambaSSMConfig:
    """A Mamba-1 mixer's `ssm_cfg` (Nanotron's examples/mamba passes it as the mixer's keyword
    arguments; null means these defaults)."""

    d_state: int = 16  # N: the state size of each channel
    d_conv: int = 4  # the depthwise causal convolution's width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: str | int = "auto"  # "auto": ceil(d_model / 16)
    dt_min: float = 0.001  # the initial dt = softplus(dt_proj.bias) is log-uniform in [min, max]
    dt_max: float = 0.1
    dt_init: str = "random"  # dt_proj.weight: random (uniform) | constant, scale dt_rank^-0.5
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj biases
    use_fast_path: bool = True  # mamba-ssm's fused kernels where installed (CUDA)


@dataclass
class MambaConfig:
    """Nanotron's examples/mamba `MambaModelConfig`: Mamba-1 blocks (RMSNorm, mixer, residual),
    tied embeddings."""

    is_mamba_config: bool = True
    d_model: int = 2560
    num_hidden_layers: int = 64
    vocab_size: int = 50277
    ssm_cfg: MambaSSMConfig | None = None
    rms_norm: bool = True  # false: LayerNorm before each mixer (the final norm stays RMSNorm)
    fused_add_norm: bool = True  # a kernel choice (mamba-ssm's Triton add+norm): same values
    residual_in_fp32: bool = True
    pad_vocab_size_multiple: int = 8  # read by Nanotron's example nowhere: kept, unused
    dtype: str = "float32"  # the example's layer dtype; mesh3d uses model.dtype for every layer
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None

    @property
    def hidden_size(self) -> int:
        """The residual stream's width (what the pipeline stages send), `d_model`."""
        return self.d_model

    @property
    def max_position_embeddings(self) -> int:
        """No position limit: the scan runs over any length (`convert from-hf` caps its
        config's sequence_length by this)."""
        return 2**31 - 1


@dataclass
class MambaInit:
    """Nanotron's examples/mamba init: linears and the convolution PyTorch's default
    (uniform ±1/sqrt(fan_in)), the embedding N(0, initializer_range), out_proj divided by
    sqrt(n_residuals_per_layer · layers) with rescale_prenorm_residual. `std` and
    `scaling_method` read it as a RandomInit does (`models/mamba_spec.py::init_for`)."""

    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    n_residuals_per_layer: int = 1

    @property
    def std(self) -> float:
        return self.initializer_range

    @property
    def scaling_method(self) -> str:
        return "NUM_LAYERS" if self.rescale_prenorm_residual else "NONE"
