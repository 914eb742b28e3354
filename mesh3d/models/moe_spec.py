"""The mixture-of-experts parts that Qwen2-MoE and Qwen3-MoE share, outside their models
(`models/moe.py`): Nanotron's names of an MoE layer, and the experts' Hugging Face conversion.

Our experts are `merged_gate_up_proj` [E, h, 2F] and `merged_down_proj` [E, F, h], applied as
x @ W; transformers 5 holds `experts.gate_up_proj` [E, 2F, h] and `experts.down_proj` [E, h, F]
in memory (applied as x @ Wᵀ, the same gate-then-up order), and writes (and the Hub holds, and
transformers 4 reads) one `experts.{e}.{gate,up,down}_proj.weight` per expert. The name maps
go to the in-memory names; `experts_to_hf` writes the per-expert form, and
`moe_weights_from_hf` reads either. Torch-free at import, like every spec module.
"""

from __future__ import annotations

from mesh3d.config.other_families import MoEConfig
from mesh3d.errors import UserError
from mesh3d.models import llama_spec
from mesh3d.models.spec import Blocks, LayerTable

# An MoE layer's MLP in Nanotron (`nn/moe.py`): the router and the stacked experts are plain
# parameters (the same on every tp rank); the shared expert is a tensor-parallel Qwen2 MLP.
MOE_LAYER: LayerTable = {
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
    "mlp.experts.merged_gate_up_proj": (("mlp.experts.merged_gate_up_proj",), "replicated"),
    "mlp.experts.merged_down_proj": (("mlp.experts.merged_down_proj",), "replicated"),
}
SHARED_EXPERT: LayerTable = {
    "mlp.shared_expert.gate_up_proj.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "column"),
    "mlp.shared_expert.down_proj.weight": (("mlp.shared_expert.down_proj.weight",), "row"),
    "mlp.shared_expert_gate.weight": (("mlp.shared_expert_gate.weight",), "replicated"),
}  # fmt: skip


def moe_from_hf(hf: dict, where, shared: bool, dense_arch: str) -> MoEConfig:
    """The `moe_config` of an HF Qwen2-MoE or Qwen3-MoE config (`shared`: with a shared
    expert): HF's sparse layers (every `decoder_sparse_step`-th, less `mlp_only_layers`) are its
    `layers`; `dense_arch` is what a config without sparse layers converts as."""
    from mesh3d.models.hf_fields import refuse

    if "num_experts" not in hf and "num_local_experts" in hf:  # transformers 5.2x's Qwen3-MoE
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    keys = ["num_experts", "num_experts_per_tok", "moe_intermediate_size"]
    keys += ["shared_expert_intermediate_size"] if shared else []
    missing = [k for k in keys if k not in hf]
    if missing:
        raise UserError(f"{where} lacks {missing}; is it a complete MoE config?")
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if hf["num_experts"] < 1 or not sparse:
        refuse(where, "an MoE config without MoE layers (num_experts, decoder_sparse_step and "
                      f"mlp_only_layers leave none; convert it as {dense_arch})")  # fmt: skip
    moe = MoEConfig(
        num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        layers=[-1] if len(sparse) == n else sparse, enable_shared_expert=shared,
    )  # fmt: skip
    if shared:
        moe.shared_expert_intermediate_size = hf["shared_expert_intermediate_size"]
    return moe


def moe_to_hf(mc) -> dict:
    """The expert fields HF's Qwen2-MoE and Qwen3-MoE configs share: the dense layers listed
    in `mlp_only_layers`, `decoder_sparse_step` 1."""
    from mesh3d.models.moe import moe_layers

    moe, sparse = mc.moe_config, set(moe_layers(mc))
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": bool(getattr(mc, "norm_topk_prob", False)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(mc.num_hidden_layers) if i not in sparse],
        "router_aux_loss_coef": moe.router_aux_loss_coef,
        "output_router_logits": False,
    }


def moe_ours_to_hf(name: str) -> str:
    return llama_spec.ours_to_hf(name.replace(".mlp.experts.merged_", ".mlp.experts."))


def moe_hf_to_ours(name: str) -> str | None:
    ours = llama_spec.hf_to_ours(name)
    if ours is not None and ours.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        ours = ours.replace(".mlp.experts.", ".mlp.experts.merged_")
    return ours


GATE_UP, DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def experts_to_hf(weights: dict, mc) -> dict:
    """Each layer's experts (still in our layout under HF's in-memory names) as one
    gate/up/down weight per expert, HF's [out, in] (what `save_pretrained` writes)."""
    out = {}
    for k, w in weights.items():
        if k.endswith(GATE_UP):  # [E, h, 2F]: gate columns, then up
            f, prefix = w.shape[-1] // 2, k.removesuffix("gate_up_proj")
            for e in range(w.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = w[e, :, :f].T.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = w[e, :, f:].T.contiguous()
        elif k.endswith(DOWN):  # [E, F, h]
            for e in range(w.shape[0]):
                out[f"{k.removesuffix('down_proj')}{e}.down_proj.weight"] = w[e].T.contiguous()
        else:
            out[k] = w
    return out


def moe_weights_from_hf(weights: dict, mc) -> dict:
    """The experts of an HF Qwen2-MoE folder, per expert (`experts.{e}.gate_proj.weight`, ...)
    or stacked (transformers 5's in-memory `experts.gate_up_proj` [E, 2F, h]), in our layout
    under HF's in-memory names (`moe_hf_to_ours` renames them)."""
    import re

    import torch

    out, per_expert = {}, {}
    for k, w in weights.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m:
            per_expert.setdefault(m[1], {})[(int(m[2]), m[3])] = w
        elif k.endswith((GATE_UP, DOWN)):
            out[k] = w.transpose(1, 2).contiguous()
        else:
            out[k] = w
    n = mc.moe_config.num_experts
    for prefix, got in per_expert.items():
        want = [(e, p) for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")]
        lacking = [f"{prefix}.{e}.{p}.weight" for e, p in want if (e, p) not in got]
        extra = [f"{prefix}.{e}.{p}.weight" for e, p in sorted(set(got) - set(want))]
        if lacking or extra:
            raise UserError(
                f"{prefix}: the {n} experts of config.json do not match the weights "
                f"(lacking {lacking[:3]}, unexpected {extra[:3]})"
            )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([got[e, "gate_proj"].T, got[e, "up_proj"].T], dim=1) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([got[e, "down_proj"].T for e in range(n)])
    return out


def blocks_with_moe() -> Blocks:
    """Llama's attention, and the MoE blocks of a Llama-like family with a `moe_config` (the
    Qwen families)."""
    from mesh3d.models.llama import Attention
    from mesh3d.models.moe import MoE

    return Blocks(attention=(Attention,), moe=(MoE,))
