"""A tensor-parallel plan's keys checked against the model it is applied to (`apply_tp`): a
key that names no submodule would leave that module unsharded without a word."""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from mesh3d.errors import UserError


def check_plan_keys(model: nn.Module, plan: dict) -> None:
    """Raise `UserError` naming the keys of `plan` that name no submodule of `model`."""
    wrong = [k for k in plan if names_nothing(model, k)]
    if wrong:
        raise UserError(
            f"tp plan key(s) {', '.join(map(repr, wrong))} name no submodule of "
            f"{type(model).__name__}; its submodules include {some_names(model)}: fix the "
            "key(s) (`*` matches one name), or the module would stay unsharded"
        )


def names_nothing(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` names no submodule and is not one a pipeline stage deleted: a name
    (without `*`) that no module on its path has as a child or as a None attribute. A `*` that
    matches nothing (a stage holding none of those layers) is not a mistake."""
    level = [model]
    for token in pattern.split("."):
        found = [c for m in level for name, c in m.named_children() if fnmatch(name, token)]
        if not found:
            deleted = any(getattr(m, token, 0) is None for m in level)
            return "*" not in token and not deleted and bool(level)
        level = found
    return False


def some_names(model: nn.Module, n: int = 6) -> str:
    """A few of `model`'s submodule names with layer numbers as `*`, for an error message."""
    names = dict.fromkeys(
        ".".join("*" if p.isdigit() else p for p in name.split("."))
        for name, _ in model.named_modules() if name
    )  # fmt: skip
    return ", ".join(list(names)[:n]) or "(none)"
