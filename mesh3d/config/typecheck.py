"""Strict mapping -> dataclass conversion, with the dotted key in every error (dacite strict by hand).

Rules: an unknown key is an error naming the closest valid key; a missing key is an error unless
it has a default or is `X | None`; `null` for a non-optional key with a default means that
default; bool is not an int; an int or a number-like string (PyYAML reads `3e-4` as one) is a
float, a finite one; `{}` for a `dict | None` key is null; a union of dataclasses is picked by a
caller's picker.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from mesh3d.errors import ConfigError

# a union's classes -> picker(value, dotted_path) -> (dataclass to build, mapping to build it from)
Pickers = dict[frozenset, Callable[[Any, str], tuple[type, dict]]]

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NONE = type(None)


def join(path: str, key: object) -> str:
    """`a.b` + `c` -> `a.b.c`; an int key is a list index: `a[1]`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def show(value: Any) -> str:
    """A value as the error message shows it: `'two' (str)`, `null`."""
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _members(tp: Any) -> tuple | None:
    """The members of a union type, or None if `tp` is not a union."""
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else None


def is_optional(tp: Any) -> bool:
    return _NONE in (_members(tp) or ())


def describe(tp: Any) -> str:
    """A type in words for error messages: `an int`, `a string or null`."""
    members = _members(tp)
    if members is not None:
        return " or ".join(dict.fromkeys(describe(m) for m in members))
    words = {int: "an int", float: "a number", bool: "true or false", str: "a string"}
    words |= {list: "a list", _NONE: "null"}
    return words.get(typing.get_origin(tp) or tp, "a mapping")  # dict and dataclasses


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def need_mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"`{path}` must be a mapping of keys, got {show(value)}")
    return value


def build(cls: type, data: Any, path: str, pickers: Pickers) -> Any:
    """Build dataclass `cls` from mapping `data` found at dotted `path`, strictly."""
    need_mapping(data, path)
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if unknown := [key for key in data if key not in names]:
        raise ConfigError(unknown_key_message(path, unknown[0], names))
    kwargs = {}
    for f in fields:
        key_path, optional = join(path, f.name), is_optional(hints[f.name])
        if f.name not in data or (data[f.name] is None and _has_default(f) and not optional):
            if _has_default(f):
                continue  # the dataclass fills in its default
            if not optional:
                raise ConfigError(f"missing required key `{key_path}`")
            kwargs[f.name] = None
        else:
            kwargs[f.name] = convert(hints[f.name], data[f.name], key_path, pickers)
    return cls(**kwargs)


def closest_key(key: str, valid: list[str]) -> str | None:
    """The valid key the user most likely meant: same letters in another case, a valid key plus a
    suffix (`tp_size` -> `tp`), else the closest spelling."""
    for name in valid:
        if name.lower() == key.lower():
            return name
    if prefixes := [name for name in valid if key.startswith(name + "_")]:
        return max(prefixes, key=len)
    return next(iter(difflib.get_close_matches(key, valid, n=1, cutoff=0.6)), None)


def unknown_key_message(path: str, key: object, valid: list[str]) -> str:
    close = closest_key(str(key), valid)
    hint = f"did you mean `{join(path, close)}`?" if close else f"valid keys: {', '.join(valid)}"
    return f"unknown key `{join(path, key)}`; {hint}"


def convert(tp: Any, value: Any, path: str, pickers: Pickers) -> Any:
    """`value` typed as `tp`, or a ConfigError naming `path`, the expected type and the value."""
    if tp is Any:
        return value
    members = _members(tp)
    if members is not None:
        return _convert_union(tp, members, value, path, pickers)
    if (pick := pickers.get(frozenset({tp}))) is not None:  # one of classes loaded on demand
        if value is None:
            raise ConfigError(f"`{path}` must be {describe(tp)}, got null")
        cls, data = pick(value, path)
        return build(cls, data, path, pickers)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, pickers)
    base = typing.get_origin(tp) or tp
    if base in (bool, int, str) and _fits(base, value):
        return value
    if base is float and (_fits(int, value) or isinstance(value, float)
                          or isinstance(value, str) and _NUMBER.fullmatch(value.strip())):  # fmt: skip
        if math.isfinite(number := float(value)):
            return number
        raise ConfigError(f"`{path}` must be a finite number, got {show(value)}")
    if base is list and isinstance(value, list):
        (item,) = typing.get_args(tp) or (Any,)
        return [convert(item, v, join(path, i), pickers) for i, v in enumerate(value)]
    if base is dict and isinstance(value, dict):
        args = typing.get_args(tp)
        if not args:
            return value
        return {k: convert(args[1], v, join(path, k), pickers) for k, v in value.items()}
    raise ConfigError(f"`{path}` must be {describe(tp)}, got {show(value)}")


def _convert_union(tp: Any, members: tuple, value: Any, path: str, pickers: Pickers) -> Any:
    others = [m for m in members if m is not _NONE]
    if value is None or (value == {} and _NONE in members and others in ([dict], [dict[str, Any]])):
        if _NONE in members:
            return None
        raise ConfigError(f"`{path}` must be {describe(tp)}, got null")
    classes = frozenset(m for m in others if dataclasses.is_dataclass(m))
    if len(classes) > 1:
        cls, data = pickers[classes](value, path)
        return build(cls, data, path, pickers)
    if len(others) == 1:
        return convert(others[0], value, path, pickers)
    for m in others:  # e.g. str | list[str]: the first member whose container type fits
        if _fits(typing.get_origin(m) or m, value):
            return convert(m, value, path, pickers)
    raise ConfigError(f"`{path}` must be {describe(tp)}, got {show(value)}")


def _fits(base: type, value: Any) -> bool:
    """`value` is a `base`; a bool is no int."""
    return isinstance(value, base) and (base is bool or not isinstance(value, bool))
