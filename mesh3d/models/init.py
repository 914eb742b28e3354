"""Layout-invariant weight initialization: each full parameter comes from its own seed.

The promise: the full weights after init do not depend on the parallel layout. So every
parameter is generated whole, in fp32 on CPU, from a generator seeded by (seed, its name in the
unsplit model, e.g. "layers.3.mlp.down_proj.weight"). A pipeline stage that kept layer 3 gets
the same tensor as the full model, and parallel code (`mesh3d.parallel`) generates the same full
tensor with `init_full_tensor` and keeps only its own shard. The cost is generating each full
tensor on every rank that holds a piece of it; the gain is that no layout can change the model.

Tied parameters are seeded by their owner's name (`model.tied_parameters`, alias -> owner), so
a last pipeline stage holding only the tied `lm_head.weight` gets the embedding's tensor.
The std rules are Nanotron's (spec §1.5.2) and live in `llama_init_std`; the rest is
model-agnostic.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from mesh3d.errors import ConfigError

SCALING_METHODS = ("NUM_LAYERS", "NONE")


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for parameter `name`, the same in every process (unlike `hash()`)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_full_tensor(
    name: str, shape: Sequence[int], std: float | None, seed: int, dtype=torch.float32
) -> Tensor:
    """The full initial value of parameter `name`: ones if `std` is None, else N(0, std^2).

    Drawn in fp32 on CPU from its own generator, then cast to `dtype`.
    """
    if std is None:
        return torch.ones(tuple(shape), dtype=dtype, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    full = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    return full.normal_(0.0, std, generator=gen).to(dtype)


def llama_init_std(
    name: str, std: float, num_layers: int, scaling_method: str = "NUM_LAYERS"
) -> float | None:
    """Nanotron's RandomInit std for parameter `name` (None means ones).

    Norm weights: ones. Biases: zeros. o_proj / down_proj (row-parallel, feeding the residual):
    std / sqrt(2 * num_layers) with scaling NUM_LAYERS, std with NONE. Everything else
    (q/k/v, gate/up, embedding, LM head): std.
    """
    if scaling_method not in SCALING_METHODS:
        raise ConfigError(
            f"`model.init_method.scaling_method` {scaling_method!r} is not supported; "
            f"use one of {SCALING_METHODS}"
        )
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if scaling_method == "NUM_LAYERS" and name.endswith(("o_proj.weight", "down_proj.weight")):
        return std / math.sqrt(2 * num_layers)
    return std


def init_weights(
    model: nn.Module,
    std: float,
    num_layers: int,
    scaling_method: str = "NUM_LAYERS",
    seed: int = 42,
    init_std_fn: Callable[..., float | None] = llama_init_std,
) -> None:
    """Initialize a materialized single-device `model` (plain tensors) in place.

    `num_layers` is the full model's (a pipeline stage holding fewer layers passes the same).
    Re-ties tied weights first (`to_empty` unties them), so ties are never initialized apart.
    """
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tied = getattr(model, "tied_parameters", {})
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter appears once
            seed_name = tied.get(name, name)
            std_p = init_std_fn(seed_name, std, num_layers, scaling_method)
            p.copy_(init_full_tensor(seed_name, p.shape, std_p, seed, p.dtype))
