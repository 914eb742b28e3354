"""Context parallelism for any `transformers` causal LM: its own attention modules call mesh3d's.

transformers lets a model's attention modules call a registered attention function instead of
SDPA (`AttentionInterface`). Under cp > 1, `parallelize_hf` registers `mesh3d_cp` and sets the
model to it: each cp rank holds its 2·cp-chunk share of every sample's tokens (a head chunk and a
tail chunk, `parallel/context.py`), the model is given their global positions (`position_ids`:
its rotary embedding turns exactly as in one process), and every attention call all-gathers K
and V over cp and attends this rank's queries to the keys before them
(`parallel/context.py::cp_attention`, the same kernel mesh3d's own families use). No mask is
built by the model: a registered function has none in transformers' mask table, so the causal
(and sliding-window) mask is made from the global positions here.

Refused (one line, before any collective): attention dropout, attention logit soft-capping
(Gemma 2's `attn_logit_softcapping`), and pipeline stages.
"""

from __future__ import annotations

import contextlib
import contextvars

from torch import Tensor, nn

from mesh3d.errors import UserError
from mesh3d.parallel.context import ContextParallel, cp_attention

NAME = "mesh3d_cp"
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("mesh3d_hf_cp", default=None)


def check_cp(model: nn.Module, cp: int) -> None:
    """What context parallelism cannot do for `model`, as one `UserError` line."""
    config, name = model.config, type(model).__name__
    for key in ("attention_dropout", "attn_pdrop"):
        if float(getattr(config, key, 0.0) or 0.0) > 0:
            raise UserError(f"cp: cp={cp} with {key}={getattr(config, key)} of {name} is not "
                            "supported (the attention drops nothing under cp); set it to 0")  # fmt: skip
    if getattr(config, "attn_logit_softcapping", None):
        raise UserError(f"cp: cp={cp} with attn_logit_softcapping of {name} is not supported; "
                        "set it to null or use cp=1")  # fmt: skip


def use_cp(model: nn.Module, cp: ContextParallel) -> None:
    """Make `model`'s attention modules call `mesh3d_cp` over `cp` (its forward must run inside
    `positions_of`)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    model.mesh3d_cp = cp


@contextlib.contextmanager
def positions_of(cp: ContextParallel, positions: Tensor):
    """The global positions of this rank's tokens [B, S/cp], for the attention calls inside."""
    token = _CURRENT.set((cp, positions))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask=None,
               dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, **kwargs) -> tuple[Tensor, None]:  # fmt: skip
    """transformers' attention-function signature: query [B, nq, S/cp, dh], key and value
    [B, nkv, S/cp, dh]; returns ([B, S/cp, nq, dh], None)."""
    current = _CURRENT.get()
    if current is None:
        raise UserError("cp: a model set to mesh3d_cp attention ran outside mesh3d's cp forward")
    cp, positions = current
    dh = query.shape[-1]
    if scaling is not None and abs(scaling - dh**-0.5) > 1e-12:  # SDPA's default is dh^-0.5
        query = query * (scaling * dh**0.5)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return cp_attention(q, k, v, positions, sliding_window, cp), None
