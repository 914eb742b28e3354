"""Which kernels a shape can use, asked by the models and by `mesh3d plan` alike."""

from __future__ import annotations

import torch

from mesh3d.torch_private import grouped_mm_available


def grouped_gemm_ok(h: int, ffn: int, itemsize: int, device=None, dtype=None) -> bool:
    """Whether experts of hidden `h` and intermediate `ffn` run as grouped GEMMs: torch has
    `_grouped_mm`, every operand row is 16-byte aligned (its kernels need it), and on CUDA the
    dtype is bfloat16 on a Hopper-class GPU (its kernel's domain); the CPU kernel takes every
    float dtype. `device` None: the CPU (what `mesh3d plan` assumes)."""
    if not grouped_mm_available() or any(n * itemsize % 16 for n in (h, ffn)):
        return False
    if device is not None and device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device is None or device.type == "cpu"
