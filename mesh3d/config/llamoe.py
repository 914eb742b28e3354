"""Nanotron's examples/moe model config (`is_llamoe_config`, its `LlaMoEConfig`). Outside
`schema.py`: the model-config picker of `load.py` imports this module when a YAML has a LlaMoE
model config, so a run of another family never loads it.

The example's model is Llama's attention (interleaved RoPE of theta 10000, no biases) with a
mixture of ungated GELU experts in every layer (`models/llamoe.py`). The fields are the
example's, with its defaults; `moe_config` presents its three expert keys as mesh3d's MoE
settings, so the MoE machinery (routing, expert parallelism, load metrics, `mesh3d plan`) reads
them as for a Qwen2-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.config.other_families import MoEConfig

MC = "model.model_config"


class LlaMoEExperts(MoEConfig):
    """A LlaMoE's expert keys as a `moe_config`: `names` says where each lives in the YAML."""

    names = {
        "num_experts": f"{MC}.moe_num_experts",
        "top_k": f"{MC}.num_experts_per_tok",
        "moe_intermediate_size": f"{MC}.intermediate_size",
    }


@dataclass
class LlaMoEConfig:
    """Nanotron's examples/moe `LlaMoEConfig`: every layer's MLP is `moe_num_experts` GELU
    experts of `intermediate_size`, `num_experts_per_tok` of them per token."""

    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    hidden_act: str = "silu"  # read by nothing in the example: its experts use GELU (tanh)
    hidden_size: int = 4096
    initializer_range: float = 0.02
    intermediate_size: int = 11008  # each expert's
    is_llamoe_config: bool = True
    max_position_embeddings: int = 2048
    num_attention_heads: int = 32
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = None  # null -> num_attention_heads at load
    pad_token_id: int | None = None
    pretraining_tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None  # the example has no scaling: null only
    tie_word_embeddings: bool = False
    use_cache: bool = True
    vocab_size: int = 32000
    moe_num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_capacity_factor: int = 1  # read by nothing in the example: its dispatch is dropless

    # what Llama's model code reads, fixed by the example's attention (not YAML keys)
    rope_interleaved = True
    rope_theta = 10000.0
    attention_bias = False
    _attn_implementation = None
    z_loss_enabled = False
    z_loss_coefficient = 0.0

    @property
    def moe_config(self) -> MoEConfig:
        """Every layer's experts as mesh3d's MoE settings: softmax, then the top k as they are,
        no balancing loss, no shared expert."""
        return LlaMoEExperts(
            num_experts=self.moe_num_experts,
            top_k=self.num_experts_per_tok,
            moe_intermediate_size=self.intermediate_size,
            router_aux_loss_coef=0.0,
            layers=[-1],
        )

    def resolve(self, cfg) -> None:
        """Called once the YAML is typed (`load.py`). Nanotron's example treats
        `expert_parallel_size` as its own axis of ranks that share one batch; mesh3d splits the
        experts over dp ranks (ep divides dp). An ep that does not divide dp (the example's dp 1,
        ep 2) keeps every expert on each rank, the same math, and says so as a warning
        (`notes`, read by `checks.config_warnings`)."""
        p = cfg.parallelism
        if p.expert_parallel_size > 1 and p.dp % p.expert_parallel_size:
            self.notes = [
                f"`parallelism.expert_parallel_size` ({p.expert_parallel_size}) does not divide "
                f"`parallelism.dp` ({p.dp}): mesh3d splits experts over dp ranks, so every rank "
                "holds every expert (the same math as Nanotron's example); set dp to a multiple "
                "of it to split them"
            ]
            p.expert_parallel_size = 1
