"""The one place mesh3d reaches torch's private APIs (list in docs/torch-notes.md).

`VERIFIED`: the installed torch is within FLOOR (pyproject's) .. CEILING. Outside it nothing fails
at import; an accessor whose private API is gone raises one `UserError` line naming it. Each
comment says which public API is missing and since which torch mesh3d uses the private one.
Inductor, dynamo, functorch and the testing package are imported lazily.
"""

from __future__ import annotations

import torch

from mesh3d.errors import UserError

FLOOR, CEILING = (2, 6), (2, 13)
TORCH_VERSION = str(torch.__version__)


def in_verified_range(version: str) -> bool:
    try:
        return FLOOR <= tuple(int(x) for x in version.split("+")[0].split(".")[:2]) <= CEILING
    except ValueError:
        return False


VERIFIED = in_verified_range(TORCH_VERSION)


def missing(api: str) -> UserError:
    """The one-line error for a private torch API that this torch lacks."""
    where = "inside" if in_verified_range(TORCH_VERSION) else "outside"
    return UserError(
        f"mesh3d needs {api}, a private torch API missing from torch {TORCH_VERSION} ({where} "
        f"the range mesh3d was verified on, torch {'.'.join(map(str, FLOOR))} to "
        f"{'.'.join(map(str, CEILING))}); install a torch in that range"
    )


def _get(owner, name: str, api: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing(api) from None


def _set(owner, name: str, value, api: str) -> None:
    _get(owner, name, api)
    setattr(owner, name, value)


def _from(module: str, name: str):  # `from module import name`, when called
    import importlib

    try:
        found = importlib.import_module(module)
        if hasattr(found, name):
            return getattr(found, name)
        return importlib.import_module(f"{module}.{name}")  # a submodule not imported yet
    except ImportError:
        raise missing(f"{module}.{name}") from None


def dtensor_spec(p):  # DTensor: no public spec getter; torch 2.6+
    return _get(p, "_spec", "DTensor._spec")


def local_tensor(p):  # the shard without to_local()'s autograd node; torch 2.6+
    return _get(p, "_local_tensor", "DTensor._local_tensor")


def apply_style(style, module, mesh):  # ParallelStyle's `_apply` has no public caller; 2.6+
    return _get(style, "_apply", "ParallelStyle._apply")(module, mesh)


def partition_fn(style, kind: str):  # Colwise/RowwiseParallel's "linear"/"embedding"; 2.6+
    name = f"_partition_{kind}_fn"
    return _get(style, name, f"{type(style).__name__}.{name}")


def child_slots(module) -> dict:  # nn.Module: no public view with its None children; 2.6+
    return module._modules


def parameter_slots(module) -> dict:  # nn.Module: no public way to swap in a plain tensor
    return module._parameters


def version_counter(t) -> int:  # Tensor._version: no public in-place counter; torch 2.6+
    return t._version


def flatten_dense_tensors(tensors):  # DDP's flat-buffer pair has no public one; 2.6+
    return _from("torch._utils", "_flatten_dense_tensors")(tensors)


def unflatten_dense_tensors(flat, tensors):
    return _from("torch._utils", "_unflatten_dense_tensors")(flat, tensors)


_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # no public grouped GEMM; optional


def grouped_mm_available() -> bool:
    return _GROUPED_MM is not None


def grouped_mm(a, b, offs):
    if _GROUPED_MM is None:
        raise missing("torch._grouped_mm")
    return _GROUPED_MM(a, b, offs=offs)


_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)  # no public "in backward"


def in_backward_recompute() -> bool:  # a checkpointed layer rerun by autograd; torch 2.6+
    if _GRAPH_TASK is None:
        raise missing("torch._C._current_graph_task_id")
    return _GRAPH_TASK() != -1


def flatten_mesh(mesh, name: str):  # DeviceMesh: no public flatten of its dims; torch 2.6+
    return _get(mesh, "_flatten", "DeviceMesh._flatten")(name)


def unflatten_mesh(mesh, dim: int, sizes, names):  # nor unflatten; newer than the floor
    return _get(mesh, "_unflatten", "DeviceMesh._unflatten")(dim, sizes, names)


def default_store():  # c10d: no public getter of the default group's store; torch 2.6+
    return _from("torch.distributed.distributed_c10d", "_get_default_store")()


def pg_timeout_setter():  # no public timeout of a live group; None where torch lacks it
    return getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)


def set_scheduler_position(scheduler, step_count: int, last_lr: list) -> None:  # 2.6+
    _set(scheduler, "_step_count", step_count, "LRScheduler._step_count")  # no public setters
    _set(scheduler, "_last_lr", last_lr, "LRScheduler._last_lr")


def set_loader_timeout(it, seconds: float) -> None:  # a DataLoader iterator's; torch 2.6+
    _set(it, "_timeout", seconds, f"{type(it).__name__}._timeout")


def loader_workers(it) -> list:  # its worker processes ([] without); no public list; 2.6+
    return getattr(it, "_workers", []) or []


def shutdown_loader_workers(it) -> None:  # no public shutdown but `del`; torch 2.6+
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def checkpoint_wrapper(module, **kwargs):  # only in a private module; torch 2.6+
    where = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    return _from(where, "checkpoint_wrapper")(module, **kwargs)


def disable_donated_buffer() -> None:  # AOTAutograd's config is private; torch 2.6+
    config = _from("torch._functorch", "config")
    _set(config, "donated_buffer", False, "torch._functorch.config.donated_buffer")


def inductor_cache_dir() -> str:  # no public getter of inductor's cache folder; 2.6+
    return _from("torch._inductor.runtime.cache_dir_utils", "cache_dir")()


def compile_counters():  # dynamo's counters ("aot_autograd" cache hits, ...); torch 2.6+
    return _from("torch._dynamo.utils", "counters")


def enable_micro_pipeline_tp() -> None:  # inductor's async-TP pass: a private flag; 2.6+
    config = _from("torch._inductor", "config")
    _set(config, "_micro_pipeline_tp", True, "torch._inductor.config._micro_pipeline_tp")


def enable_symm_mem_for_group(group_name: str) -> None:  # a private module; torch 2.6+
    _from("torch.distributed._symmetric_memory", "enable_symm_mem_for_group")(group_name)


def fake_store():  # the fake process group's store (registers "fake"); torch 2.6+
    return _from("torch.testing._internal.distributed.fake_pg", "FakeStore")()


def pipeline_schedule_base() -> type:  # the schedules' common base class is private; 2.6+
    return _from("torch.distributed.pipelining.schedules", "_PipelineSchedule")
