"""What the tests/*/test_plan*.py files share: configs on the tiny parity model, and measurements
taken inside training ranks (bytes held by parameters, gradients and optimizer state; the peak of
the bytes saved for backward) to compare with `mesh3d.plan`'s numbers."""

import copy
import weakref

import torch
from parity import TINY
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mesh3d.config import apply_overrides, config_from_dict
from mesh3d.train.hooks import KeepModel
from mesh3d.train.loop import train

PP2 = ["parallelism.pp=2", "model.model_config.num_hidden_layers=4", "tokens.train_steps=2"]
ONE_STEP = ["tokens.train_steps=1", "tokens.micro_batch_size=2"]


def plan_cfg(overrides: list[str]):
    return apply_overrides(config_from_dict(copy.deepcopy(TINY)), overrides)


def pp_schedule(schedule: str, virtual: int = 1) -> list[str]:
    return [f"mesh3d.pp_schedule={schedule}", f"mesh3d.pp_virtual_stages={virtual}"]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def held_bytes(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """Inside a rank: train each config; local bytes of params, grads (at the last optimizer
    step, before zero_grad) and optimizer state (after it)."""
    out = []
    for overrides in runs:
        grads: dict[str, int] = {}

        def before_step(opt, args, kwargs, grads=grads):
            ps = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads["bytes"] = nbytes([p.grad for p in ps])

        handle = register_optimizer_step_pre_hook(before_step)
        try:
            res = train(plan_cfg(overrides), hooks=[KeepModel()])
        finally:
            handle.remove()
        params = list(res.model.parameters())
        state = [t for s in res.optimizer.state.values() for t in s.values()]
        elements = sum(local(p).numel() for p in params)
        out.append(
            dict(
                elements=elements,
                params=nbytes(params),
                grads=grads["bytes"],
                optim=nbytes(state),
            )
        )
    return out


class Held:
    """What the pack hook hands autograd: the tensor, and a weakref target that dies when the
    graph releases it (after the backward that used it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Peak of the bytes saved for backward that are alive at once.

    How it is measured: a `saved_tensors_hooks` pack hook sees every tensor autograd saves (in
    checkpointed layers, only the layer inputs: recomputation has its own hooks). Each is
    unwrapped to its plain storages (DTensor local tensors, async collective results). A storage
    counts once, by pointer, while any saved tensor uses it, with its full `nbytes`; it stops
    counting when autograd drops the last packed handle that uses it (a weakref finalizer).
    Parameters and views of them are left out (their storages, and those of the module's
    children, are collected by a global forward pre-hook before a module runs), so what remains
    are activations.
    """

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage pointer -> [handles, nbytes]
        self.params: set[int] = set()
        self.current = self.peak = 0

    def note_params(self, module: nn.Module, args) -> None:
        # recursively: a module can use a child's parameters without calling it (the MoE block
        # slices its stacked experts, and applies its router weight with F.linear)
        for p in module.parameters():
            self.params.update(s.data_ptr() for s in self._storages(p))

    @staticmethod
    def _storages(t: torch.Tensor):
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    yield from SavedBytes._storages(inner)
        else:
            yield t.untyped_storage()

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        held = Held(t.detach())  # no grad_fn: a saved output would hold its own node (a cycle)
        for storage in self._storages(t):
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in self.params:
                continue
            entry = self.live.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
            entry[0] += 1
            weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, Held) else held


def saved_peaks(rank: int, world: int, runs: list[list[str]]) -> list[int]:
    peaks = []
    for overrides in runs:
        meter = SavedBytes()
        hook = nn.modules.module.register_module_forward_pre_hook(meter.note_params)
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                train(plan_cfg(overrides))
        finally:
            hook.remove()
        peaks.append(meter.peak)
    return peaks


def cp_overrides(n: int, *more: str) -> list[str]:
    return [f"parallelism.context_parallel_size={n}", *ONE_STEP, *more]


def cp_measured(rank: int, world: int, runs: list) -> list[dict]:
    """Inside a rank: train each config once; the peak of the bytes saved for backward, the
    local bytes of params, grads and optimizer state (as `held_bytes`), and per cp collective kind
    its calls and bytes (all-gather output, reduce-scatter input: the plan's payloads)."""
    import mesh3d.parallel.context as context

    out = []
    for cfg in runs:
        meter, grads, cp = SavedBytes(), {}, {}

        def count(fn, kind, cp=cp):
            def wrapped(out, inp, group=None):
                full = out if kind == "all_gather" else inp
                key = f"{kind} {full.dtype}"
                calls, nbytes = cp.get(key, (0, 0))
                cp[key] = (calls + 1, nbytes + full.numel() * full.element_size())
                return fn(out, inp, group=group)

            return wrapped

        def before_step(opt, args, kwargs, grads=grads):
            ps = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            grads["bytes"] = nbytes([p.grad for p in ps])

        flat = context.all_gather_flat, context.reduce_scatter_flat
        context.all_gather_flat = count(flat[0], "all_gather")
        context.reduce_scatter_flat = count(flat[1], "reduce_scatter")
        handles = [
            register_optimizer_step_pre_hook(before_step),
            nn.modules.module.register_module_forward_pre_hook(meter.note_params),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                res = train(cfg, hooks=[KeepModel()])
        finally:
            context.all_gather_flat, context.reduce_scatter_flat = flat
            for h in handles:
                h.remove()
        params = list(res.model.parameters())
        state = [t for s in res.optimizer.state.values() for t in s.values()]
        out.append(dict(saved=meter.peak, elements=sum(local(p).numel() for p in params),
                        params=nbytes(params), grads=grads["bytes"], optim=nbytes(state),
                        cp=cp))  # fmt: skip
    return out


def cpu_causal_masks(cfg, cp_rank: int, itemsize: int) -> int:
    """Bytes the plan leaves out: SDPA on CPU saves the lower-right causal mask of each query
    chunk whose keys outnumber its queries (every chunk but the first) as a [c, keys] tensor
    in the compute dtype (`itemsize` bytes), one per chunk shape shared by every layer; none
    under recompute."""
    if cfg.parallelism.recompute_layer:
        return 0
    cp = cfg.parallelism.context_parallel_size
    c = cfg.tokens.sequence_length // (2 * cp)
    return sum(c * (k + 1) * c for k in (cp_rank, 2 * cp - 1 - cp_rank) if k > 0) * itemsize
