"""Dotted command-line overrides on the raw config mapping: `parallelism.tp=2`, `data_stages[0].data.seed=3`.

The value is read with `yaml.safe_load`, typed as in the file. Overrides edit the mapping before
it is typed, so an unknown key fails with the file's message. A missing or null section is created.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Sequence
from typing import Any

import yaml

from mesh3d.config.typecheck import join
from mesh3d.errors import ConfigError

_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")
_EXAMPLE = "write key=value, e.g. parallelism.tp=2 or data_stages[0].data.seed=3"


def parse_override(token: str) -> tuple[list[str | int], Any]:
    """`a.b[1].c=v` -> (["a", "b", 1, "c"], yaml value of v)."""
    if "=" not in token:
        raise ConfigError(f"override `{token}` has no `=`; {_EXAMPLE}")
    key, text = token.split("=", 1)
    parts: list[str | int] = []
    for segment in key.strip().split("."):
        m = _SEGMENT.fullmatch(segment)
        if m is None:
            raise ConfigError(f"override `{token}`: `{key}` is not a dotted key; {_EXAMPLE}")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r"\d+", m.group(2)))
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override `{token}`: the value is not valid YAML: {yaml_problem(e)}; quote a "
            f"value meant as text: {key}='\"{text}\"'"
        ) from None
    return parts, value


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line (what and where, 1-based), without its copies of the source."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    after = f" ({context} from line {start.line + 1}, column {start.column + 1})" if (
        context and start is not None) else ""  # fmt: skip
    return f"{where}{problem}{after}"


def _set(root: dict, parts: list[str | int], value: Any, token: str) -> None:
    node: Any = root
    for i, part in enumerate(parts):
        where = functools.reduce(join, parts[:i], "") or "the config"
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = f"a list of {len(node)}" if isinstance(node, list) else _kind(node)
                raise ConfigError(
                    f"override `{token}`: `{where}` has no item [{part}] (it is {size})"
                )
        elif not isinstance(node, dict):
            raise ConfigError(
                f"override `{token}`: `{where}` is {_kind(node)}, so it has no key `{part}`"
            )
        if i == len(parts) - 1:
            node[part] = value
        elif isinstance(part, str) and node.get(part) is None and isinstance(parts[i + 1], str):
            node[part] = {}
        node = node[part] if isinstance(part, int) else node.get(part)


def _kind(node: Any) -> str:
    return "null" if node is None else f"{node!r} ({type(node).__name__}), not a mapping"


def apply_to_dict(raw: dict, overrides: Sequence[str]) -> dict:
    """A copy of `raw` with each `key=value` in `overrides` set, in order."""
    out = copy.deepcopy(raw)
    for token in overrides:
        _set(out, *parse_override(token), token)
    return out
