"""A tensor-parallel plan's keys checked against the model `apply_tp` applies it to: a key that
names no submodule would leave that module unsharded without a word."""

from __future__ import annotations

from fnmatch import fnmatch

from mesh3d.errors import UserError


def check_plan_keys(model, plan: dict) -> None:
    """Raise `UserError` naming the keys of `plan` that name no submodule of `model`."""
    if wrong := [k for k in plan if names_nothing(model, k)]:
        names = dict.fromkeys(".".join("*" if p.isdigit() else p for p in n.split("."))
                              for n, _ in model.named_modules() if n)  # fmt: skip
        raise UserError(
            f"tp plan key(s) {', '.join(map(repr, wrong))} name no submodule of "
            f"{type(model).__name__}; its submodules include {', '.join(list(names)[:6])}: fix "
            "the key(s) (`*` matches one name), or the module would stay unsharded"
        )


def names_nothing(model, pattern: str) -> bool:
    """A name (no `*`) that no module on `pattern`'s path has as a child, nor as a None
    attribute (a module a pipeline stage deleted); a `*` over nothing (a stage without those
    layers) is no mistake."""
    level = [model]
    for token in pattern.split("."):
        found = [c for m in level for name, c in m.named_children() if fnmatch(name, token)]
        if not found:
            return "*" not in token and not any(getattr(m, token, 0) is None for m in level)
        level = found
    return False
