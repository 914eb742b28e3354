"""User-facing errors: one message that names the key or file, the numbers and the fix.

Anything a user can get wrong (a config value, a missing file, a layout that does not fit the
world size) raises `UserError` or a subclass. Entry points catch it with `exit_on_user_error`,
print the message without a traceback and exit with code 2. Our own broken invariants stay
`assert`s and keep their tracebacks.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

USER_ERROR_EXIT_CODE = 2

F = TypeVar("F", bound=Callable)


class UserError(ValueError):
    """A mistake in what the user gave us; the message says what to change.



    Example:



        raise mesh3d.UserError("`tokens.sequence_length` 0 must be >= 1; raise it")


    """


class ConfigError(UserError):
    """A config file or override that cannot be used as given.



    Example:



        try:


            mesh3d.validate(cfg, 8)


        except mesh3d.ConfigError as e:


            print(e)


    """


def exit_on_user_error(fn: F) -> F:
    """Decorate a CLI `main`: a `UserError` prints `error: <message>` to stderr and exits 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR_EXIT_CODE) from None

    return wrapper  # type: ignore[return-value]
