"""`mesh3d.async_tp`: torch's asynchronous tensor parallelism, switched on before any compile.

Inductor's micro-pipeline TP pass (`torch._inductor.config._micro_pipeline_tp`) finds, inside
compiled graphs, an all-gather feeding matmuls and matmuls feeding a reduce-scatter, and splits
them into pieces so each piece's communication overlaps the previous piece's matmul. Under
mesh3d's sequence-parallel plan (tp_mode REDUCE_SCATTER) those are the gather of each attention /
MLP block's input and the reduce-scatter after o_proj / down_proj; with `mesh3d.compile` the
blocks, and the hooks that gather their input, are compiled, so these collectives are in the
graphs the pass reads. The fused kernels run on symmetric memory, which the pass uses only for
groups registered with it: the tp group is registered here. CUDA with NCCL only: whether the pass
fuses mesh3d's graphs, and what it gains, has not been seen yet (no GPU where this was written).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed import ProcessGroup

from mesh3d.checks.speed import ASYNC_TP_NEEDS
from mesh3d.errors import ConfigError
from mesh3d.torch_private import enable_micro_pipeline_tp, enable_symm_mem_for_group


def check_async_tp(device: torch.device, tp_group: ProcessGroup) -> None:
    """Refuse `mesh3d.async_tp` where it cannot run: not CUDA, or a tp group that is not NCCL."""
    backend = torch.distributed.get_backend(tp_group)
    if device.type != "cuda" or "nccl" not in backend:
        raise ConfigError(
            f"`mesh3d.async_tp` needs {ASYNC_TP_NEEDS}; this run is on {device.type} with "
            f"{backend}. Set mesh3d.async_tp: false (or run on CUDA GPUs)"
        )


def enable_async_tp(tp_group: ProcessGroup) -> None:
    """Turn on inductor's micro-pipeline TP pass and symmetric memory for `tp_group`; call
    before the first compiled forward (the pass runs when a graph is compiled)."""
    enable_micro_pipeline_tp()
    with warnings.catch_warnings():
        # torch 2.13 marks it deprecated ("no need to call"), yet its micro-pipeline pass
        # still skips a group unless `is_symm_mem_enabled_for_group`, which only this sets
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_group.group_name)
