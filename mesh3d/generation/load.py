"""The single-device model of a step folder, with its full weights (any layout wrote them)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mesh3d import extensions
from mesh3d.checkpoint.model_config import read_model_config_json, shape_of
from mesh3d.checkpoint.nanotron_weights import read_nanotron_weights
from mesh3d.checkpoint.training import lora_of
from mesh3d.errors import UserError
from mesh3d.models.registry import spec_of


def load_model(step: Path, device: torch.device) -> tuple[nn.Module, object]:
    """The single-device model of a step folder with its full weights; its model config."""
    mc = read_model_config_json(step)
    if not (step / "model").is_dir():
        raise UserError(f"{step} has no model/ folder of weights; give a checkpoint step folder")
    if lora_of(step) is not None:  # a LoRA run's: its base with the adapters merged
        full = extensions.load("lora_files").merged_weights(step)
    else:
        full = read_nanotron_weights(step / "model", shape_of(mc))
    with torch.device("meta"):  # no random init: every tensor comes from the files
        model = spec_of(mc).build(mc, vocab_size=mc.vocab_size, attention="auto")
    missing, unexpected = model.load_state_dict(full, strict=False, assign=True)
    assert not unexpected and set(missing) <= set(model.tied_parameters), (missing, unexpected)
    model.tie_weights()
    dtype = torch.float32 if device.type == "cpu" else full["embed_tokens.weight"].dtype
    return model.to(device=device, dtype=dtype).eval(), mc
