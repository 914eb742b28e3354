"""A LoRA run's step folder outside training: its adapters, its base, the two merged, and the
adapters written as a PEFT adapter folder.

A LoRA step folder (`mesh3d.lora`) holds the adapters under `model/` (each split over tp as it
was on the ranks) and, in `checkpoint_metadata.json`'s `custom_metas.lora`, the adapter
settings and its base: a folder (Nanotron layout or Hugging Face, fingerprinted) or the seeded
random init (std, scaling, seed). `merged_weights` rebuilds the base from that and folds the
adapters in: what `mesh3d convert to-hf` exports and what one-process `mesh3d generate` runs.
`write_peft` writes `adapter_config.json` + `adapter_model.safetensors` in peft's names, which
`peft.PeftModel.from_pretrained` loads onto the Hugging Face export of the base.

    full = merged_weights(step)               # our names -> full tensors, adapters folded in
    write_peft(step, "out/adapter")           # peft's adapter folder
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from torch import Tensor

from mesh3d import extensions
from mesh3d.checkpoint.folder import is_hf_folder
from mesh3d.checkpoint.model_config import read_model_config_json, shape_of
from mesh3d.checkpoint.nanotron_weights import (
    Param,
    read_nanotron_weights,
    read_param,
    save_readable,
)
from mesh3d.checkpoint.training import lora_of
from mesh3d.errors import UserError, on_every_rank, unwritable
from mesh3d.models.registry import spec_of
from mesh3d.parallel.parallelize import seeded_init

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_params(plan, pp_rank: int = 0, held=None) -> list[Param]:
    """The parameters a LoRA run's checkpoint holds (`plan`: `models/lora.py::LoraPlan`): its
    adapters only, under their own names, each split over tp as it is on the ranks (`held`:
    only those this rank holds)."""
    return [Param(n, (n,), (s[0],), s, plan.adapter_kind(n), pp_rank)
            for n, s in plan.adapter_shapes().items() if held is None or n in held]  # fmt: skip


def check_lora_match(step_dir: Path, saved: dict | None, cfg, layout) -> None:
    """Refuse (on every rank) a LoRA checkpoint for a run without the same adapters and base,
    and a full checkpoint for a LoRA run."""
    plan = layout.lora
    if saved is None and plan is None:
        return
    if saved is None:
        error = UserError(
            f"{step_dir} holds full weights, not LoRA adapters: to start adapters on it, put it "
            "in model.init_method.path (not checkpoints.resume_checkpoint_path)"
        )
    elif plan is None:
        error = UserError(
            f"{step_dir} holds LoRA adapters only (r={saved['r']}, {len(saved['modules'])} "
            "modules): resume it with the same `mesh3d.lora` settings it was saved with"
        )
    elif plan.to_json() != {k: saved[k] for k in ("r", "lora_alpha", "modules", "shapes")}:
        error = UserError(
            f"{step_dir} holds LoRA adapters r={saved['r']}, lora_alpha={saved['lora_alpha']} on "
            f"{len(saved['modules'])} modules, but `mesh3d.lora` now gives r={plan.r}, "
            f"lora_alpha={plan.lora_alpha} on {len(plan.modules)}: resume with the settings "
            "it was saved with"
        )
    else:
        try:
            extensions.load("lora").check_base(saved["base"], cfg, str(step_dir))
            return
        except UserError as e:
            error = e
    raise on_every_rank(error)


def not_a_base(path: Path) -> UserError:
    """The error for a LoRA step folder given as `model.init_method.path`."""
    return UserError(
        f"`model.init_method.path` {path} holds LoRA adapters only, not a model; export the "
        f"merged model (`mesh3d convert to-hf --checkpoint {path} --output <dir>`) and start "
        "from that folder, or resume the adapters with checkpoints.resume_checkpoint_path"
    )


def lora_meta(cfg, plan) -> dict:
    """What a LoRA step folder's metadata says of its adapters and base (`custom_metas.lora`)."""
    return {**plan.to_json(), "base": extensions.load("lora").base_fingerprint(cfg)}


def plan_of(step: Path):
    """The `LoraPlan` of a LoRA step folder, or a UserError when `step` holds full weights."""
    meta = lora_of(step)
    if meta is None:
        raise UserError(f"{step} holds full weights, not LoRA adapters (no `lora` in its metadata)")
    return extensions.load("lora").LoraPlan.from_json(meta)


def adapter_weights(step: Path) -> dict[str, Tensor]:
    """Adapter name (ours) -> full tensor, from a LoRA step folder saved at any layout."""
    return {p.name: read_param(step / "model", p) for p in adapter_params(plan_of(step))}


def _real_vocab(step: Path, padded: int) -> int:
    path = step / "config.yaml"
    if not path.is_file():
        return padded
    raw = yaml.safe_load(path.read_text()) or {}
    return int(raw.get("model", {}).get("model_config", {}).get("vocab_size") or padded)


def _fit_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    n = min(rows, t.shape[0])
    out[:n] = t[:n]
    return out


def base_weights(step: Path) -> dict[str, Tensor]:
    """The full base weights (our names, at the step's padded vocabulary) a LoRA step folder's
    adapters apply to, checked against the fingerprint it saved."""
    base = lora_of(step)["base"]
    mc = read_model_config_json(step)
    shape = shape_of(mc)
    spec = spec_of(mc)
    vocab_rows = ("embed_tokens.weight", "lm_head.weight")
    if base["init"] == "random":
        vocab = _real_vocab(step, shape.padded_vocab)
        init_std = spec.init_std
        std, scaling = base["std"], base.get("scaling_method", "NUM_LAYERS")
        full = seeded_init(lambda n: init_std(n, std, shape.num_layers, scaling), base["seed"],
                           dict.fromkeys(vocab_rows, vocab))  # fmt: skip
        out = {n: full(n, s) for n, s in spec.param_shapes(shape).items()}
    else:
        root = Path(base["path"])
        if not root.exists():
            raise UserError(
                f"{step}: its LoRA base {root} is missing; put the base back there (the "
                "adapters are useless without it)"
            )
        lora = extensions.load("lora")
        if not lora.same_base(base, lora.folder_fingerprint(root)):
            raise UserError(
                f"{step}: its LoRA base {root} changed since the adapters were trained (its "
                "fingerprint differs); restore the base the adapters were trained on"
            )
        if is_hf_folder(root):
            from mesh3d.checkpoint.hf import hf_config_of, hf_to_ours, permute_qk, read_hf_weights

            theirs, arch = hf_config_of(root)
            out = hf_to_ours(read_hf_weights(root), theirs, root, arch)
            if getattr(mc, "rope_interleaved", False):
                out = permute_qk(out, shape.head_dim, to_interleaved=True)
        else:
            saved = read_model_config_json(root)
            out = read_nanotron_weights(root / "model", shape_of(saved))
        out = {
            k: _fit_rows(v, shape.padded_vocab) if k in vocab_rows else v for k, v in out.items()
        }
    if shape.tied:
        out.pop("lm_head.weight", None)
    return out


def merged_weights(step: Path) -> dict[str, Tensor]:
    """The full weights of a LoRA step folder: its base with every adapter folded in (W + alpha
    / r · B A, in the base's dtype)."""
    plan = plan_of(step)
    return extensions.load("lora").merged(base_weights(step), adapter_weights(step), plan)


def write_peft(step: Path, output: Path) -> list[Path]:
    """Write the adapters of LoRA step folder `step` as a PEFT adapter folder; the paths.

    Names are the Hugging Face export's (`base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight`); q/k adapters of a `rope_interleaved` model get the rows the export gives q/k.
    A projection mesh3d fuses and Hugging Face splits (Starcoder2's qkv_proj) is refused."""
    from safetensors import SafetensorError

    from mesh3d.checkpoint.hf import permute_qk

    output = Path(output)
    try:  # before any work: a path that cannot be a folder is refused at once
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable("--output", output, e) from None
    plan = plan_of(step)
    mc = read_model_config_json(step)
    shape = shape_of(mc)
    arch = spec_of(mc).hf_of(mc)
    adapters = adapter_weights(step)
    if getattr(mc, "rope_interleaved", False):  # B's rows are the projection's output rows
        bs = {f"{m}.weight": adapters[f"{m}.lora_B.weight"] for m in plan.modules}
        bs = permute_qk(bs, shape.head_dim, to_interleaved=False)
        adapters.update({f"{k.removesuffix('.weight')}.lora_B.weight": v for k, v in bs.items()})
    hf_names = _hf_names(mc, shape)
    tensors, modules = {}, []
    for m in plan.modules:
        theirs = arch.ours_to_hf(f"{m}.weight")
        if theirs not in hf_names:
            raise UserError(f"{m} is one fused projection in mesh3d and several in Hugging Face: "
                            "a PEFT adapter of it is not supported yet; export the merged model "
                            "with `mesh3d convert to-hf` instead")  # fmt: skip
        module = theirs.removesuffix(".weight")
        modules.append(module)
        for which in ("lora_A", "lora_B"):
            t = adapters[f"{m}.{which}.weight"]
            tensors[f"base_model.model.{module}.{which}.weight"] = t.contiguous()
    leaves = sorted({m.rsplit(".", 1)[1] for m in modules})
    if len(modules) == shape.num_layers * len(leaves) and not shape.moe_layers:
        targets = leaves  # every layer's: peft's usual list of names
    else:  # some layers, or names an MoE layer's experts share: each module exactly
        targets = "|".join(sorted(m.replace(".", r"\.") for m in modules))
    base = lora_of(step)["base"]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": plan.r,
        "lora_alpha": plan.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": base.get("path"),
    }
    try:  # the weights first: a folder without the config is no adapter to peft
        save_readable(tensors, output / ADAPTER_WEIGHTS, {"format": "pt"})
        (output / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    except (OSError, SafetensorError) as e:
        error = e if isinstance(e, OSError) else OSError(str(e))
        raise unwritable("--output", output, error) from None
    return [output / ADAPTER_CONFIG, output / ADAPTER_WEIGHTS]


def _hf_names(mc, shape) -> set[str]:
    """The weight names of the Hugging Face export of a model (shapes only, on meta)."""
    spec = spec_of(mc)
    arch = spec.hf_of(mc)
    ours = {arch.ours_to_hf(k): torch.empty(s, device="meta")
            for k, s in spec.param_shapes(shape).items()}  # fmt: skip
    return set(arch.weights_to_hf(ours, mc) if arch.weights_to_hf else ours)
