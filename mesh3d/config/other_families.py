"""The model configs of Nanotron's families other than Llama (Qwen2 with its MoE, mesh3d's
Qwen3, Starcoder2), as `config/schema.py` writes Llama's: loaded when a config names one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    router_aux_loss_coef: float = 0.01
    layers: list[int] = field(default_factory=lambda: [-1])  # [-1] = every layer
    enable_shared_expert: bool = False
    token_dispatcher_type: str = "alltoall"  # alltoall | allgather


@dataclass
class Qwen2Config:
    bos_token_id: int | None = 1  # null kept (an HF config's null; from-hf writes it)
    eos_token_id: int | None = 2
    hidden_act: str = "silu"
    hidden_size: int = 4096
    initializer_range: float = 0.02
    intermediate_size: int = 11008
    is_qwen2_config: bool = True
    max_position_embeddings: int = 2048
    num_attention_heads: int = 32
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = None
    pad_token_id: int | None = None
    pretraining_tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    interleaved_rotary: bool | None = None  # in Nanotron's examples, not its schema: unused
    rope_seq_len_interpolation_factor: float | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True
    vocab_size: int = 32000
    _attn_implementation: str | None = "flash_attention_2"
    flex_attention_mask: str | None = None
    attention_bias: bool = False
    sliding_window_size: int | None = None
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 1e-4
    no_rope_layer: int | None = None
    _fused_rotary_emb: bool = True
    _fused_rms_norm: bool = True
    _use_qkv_packed: bool = True
    _use_doc_masking: bool = False
    log_attn_probs: bool = True
    ring_attn_heads_k_stride: int | None = None
    moe_config: MoEConfig | None = None


@dataclass
class Qwen3Config(Qwen2Config):
    """Qwen3 (Qwen2 plus per-head q/k RMSNorm and a free head size; with `moe_config`, Qwen3-MoE).

    Nanotron has none: how a YAML and a checkpoint write it is in config/families.py."""

    is_qwen3_config: bool = True
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    norm_topk_prob: bool = False  # MoE: each token's top-k router weights divided by their sum


@dataclass
class Starcoder2Config:
    activation_function: str = "gelu_pytorch_tanh"
    attention_softmax_in_fp32: bool = True
    attn_pdrop: float = 0.1
    bos_token_id: int = 49152
    embd_pdrop: float = 0.1
    eos_token_id: int = 49152
    global_attn_layers: list[int] = field(default_factory=list)
    grouped_query: bool = False
    hidden_size: int = 2048
    initializer_range: float = 0.02
    intermediate_size: int | None = None
    is_starcoder2_config: bool = True
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    multi_query: bool = False
    num_attention_heads: int = 16
    num_hidden_layers: int = 24
    num_kv_heads: int | None = None
    resid_pdrop: float = 0.1
    # Nanotron types it Optional[int] (its strict parser refuses 10000.0); a float is kept for
    # bases no int holds (HF starcoder2-3b's 999999.44...)
    rope_theta: int | float | None = 10000
    scale_attention_softmax_in_fp32: bool = True
    scale_attn_weights: bool = True
    sliding_window_size: int | None = None
    use_position_embeddings: bool = False
    use_rotary_embeddings: bool = True
    vocab_size: int = 49280
    _attn_implementation: str | None = "flash_attention_2"
