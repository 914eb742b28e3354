"""`model.dtype` names -> torch dtypes (the names: `models/activations.py::TRAIN_DTYPES`)."""

from __future__ import annotations

import torch

from mesh3d.models.activations import TRAIN_DTYPES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in TRAIN_DTYPES}
