"""`mesh3d.compile`: each block compiled in place, a compile cache of this rank and layout, and
what the run says about compiling; loaded only when the config turns compile on."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mesh3d.torch_private import compile_counters, disable_donated_buffer, inductor_cache_dir


def compile_blocks(model: nn.Module, kinds: tuple[type, ...], mesh: DeviceMesh | None = None,
                   split_backward: bool = False) -> None:  # fmt: skip
    """`torch.compile` in place each block of a kind in `kinds` inside each decoder layer.

    Not whole layers: a tensor-parallel layer fails in backward (docs/torch-notes.md). The
    two-pass backward of zero-bubble schedules (`split_backward`) needs no donated buffers."""
    if mesh is not None:
        private_compile_cache(mesh)
    if split_backward:
        disable_donated_buffer()
    for layer in model.layers.values():
        for module in layer.modules():
            if type(module) in kinds:  # exactly: not the shared expert (an MLP subclass)
                module.compile()


def private_compile_cache(mesh: DeviceMesh) -> str:
    """Point torch.compile's cache at a folder of this rank and layout; returns the folder.

    torch 2.13's AOTAutograd cache keys DTensor graphs without the rank but stores rank-specific
    code (pytorch/pytorch#188390). Must run before the first compile; idempotent."""
    layout = "-".join(f"{n}{k}" for n, k in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    own = f"mesh3d-{layout}-rank{torch.distributed.get_rank()}"
    base = inductor_cache_dir()
    if os.path.basename(base).startswith("mesh3d-"):  # set before, by this function
        base = os.path.dirname(base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, own)
    return inductor_cache_dir()


def compile_notice() -> str:
    """Said before the first compiled step, which is silent for as long as compiling takes."""
    folder = inductor_cache_dir()
    return (
        "torch.compile (mesh3d.compile): the first step compiles the model's blocks, which "
        f"takes a while (tens of seconds); the graphs are cached in {folder} for next runs"
    )


def compile_cache_text() -> str:
    """What torch.compile did so far in this process: graphs compiled, and loaded from its cache."""
    aot, folder = compile_counters()["aot_autograd"], inductor_cache_dir()
    return (
        f"torch.compile: {aot['autograd_cache_hit']} graphs loaded from the cache in {folder}, "
        f"{aot['autograd_cache_miss']} compiled and saved, {aot['autograd_cache_bypass']} "
        "compiled and not cacheable"
    )
