"""Layout-invariant weight initialization: each full parameter comes from its own seed.

Every parameter is generated whole, in fp32 on CPU, seeded by (seed, its name in the unsplit
model), so no layout changes the weights: parallel code generates the same full tensor with
`init_full_tensor` and keeps its shard. Tied parameters are seeded by their owner's name.
The std rules live in each family's spec (`init_std`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for parameter `name`, the same in every process (unlike `hash()`)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_full_tensor(
    name: str, shape: Sequence[int], std: float | Callable | None, seed: int, dtype=torch.float32
) -> Tensor:
    """The full initial value of parameter `name`, cast to `dtype`: ones if `std` is None,
    N(0, std^2) for a number, `std(shape, generator)` for a function."""
    if std is None:
        return torch.ones(tuple(shape), dtype=dtype, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    if callable(std):
        return std(tuple(shape), gen).to(dtype)
    full = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
    return full.normal_(0.0, std, generator=gen).to(dtype)


def init_weights(
    model: nn.Module,
    std: float,
    num_layers: int,
    scaling_method: str = "NUM_LAYERS",
    seed: int = 42,
    init_std_fn: Callable[..., float | None] | None = None,
) -> None:
    """Initialize a materialized single-device `model` (plain tensors) in place.

    `init_std_fn` defaults to Llama's rule; `num_layers` is the full model's. Re-ties tied
    weights first (`to_empty` unties them).
    """
    if init_std_fn is None:
        from mesh3d.models.llama_spec import init_std as init_std_fn
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    tied = getattr(model, "tied_parameters", {})
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter appears once
            seed_name = tied.get(name, name)
            std_p = init_std_fn(seed_name, std, num_layers, scaling_method)
            p.copy_(init_full_tensor(seed_name, p.shape, std_p, seed, p.dtype))
