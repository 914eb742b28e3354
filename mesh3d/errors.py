"""User-facing errors and the ways a run stops early, each with its own exit code.

    code  exception              meaning
    0     -                      trained to tokens.train_steps
    2     UserError              a config, file or checkpoint that cannot be used as given
    3     NonFiniteError         a NaN/inf loss or gradient norm; no update, nothing saved
    3     LossSpikeError         the loss or gradient norm spiked too many steps in a row
    4     PeerError              a rank did not arrive (stopped, dead, hung) or the launcher died
    4     DataWorkerError        a data-loading worker process died, hung or failed
    5     CheckpointWriteError   a save could not be written; the previous checkpoint is intact
    75    Preempted              a stop signal: the step finished and a checkpoint was saved
    128+N Interrupted            signal N stopped the run and nothing was saved

Entry points catch them with `exit_on_user_error`: one `error: ...` line, no traceback, that
exit code. Our own broken invariants stay `assert`s and keep their tracebacks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from signal import SIGINT
from typing import TypeVar

USER_ERROR_EXIT_CODE = 2
# How long a rank but 0 waits before exiting with an error every rank raised, under an elastic
# agent (which stops every rank once one exits), so that rank 0 prints it first
RANK0_GRACE_S = 5.0

F = TypeVar("F", bound=Callable)


def not_divisible(key: str, value: int, by_key: str, by: int, fix: str) -> list[str]:
    """[the message] when `key` (value) is not a multiple of `by_key` (by), else []."""
    return (
        [f"`{key}` ({value}) must be divisible by `{by_key}` ({by}); {fix}"] if value % by else []
    )


def not_supported_yet(key: str, what: str) -> str:
    """The message for a setting mesh3d does not implement yet: the key, then what to do."""
    return f"`{key}` is not supported by mesh3d yet ({what})"


def unwritable(
    key: str, path, error: OSError, fix: str = "choose a folder you can write"
) -> UserError:
    """The `UserError` for output path `path` (of `key`) that the OS refused with `error`."""
    reason = error.strerror or str(error)
    if isinstance(error, FileExistsError | NotADirectoryError):
        reason += ": a file is where a folder is needed"
    return UserError(f"`{key}` {path}: cannot write there ({reason}); {fix}")


class UserError(ValueError):
    """A mistake in what the user gave us; the message says what to change. Set
    `same_on_every_rank` on one that every rank raised alike, so that only rank 0 prints it.

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


class RunStopped(Exception):
    """A training run that stopped before `tokens.train_steps`; `exit_code` says why."""

    exit_code = 1
    same_on_every_rank = True


class NonFiniteError(RunStopped):
    """A non-finite loss or gradient norm (or tensor in a save): nothing of it was kept."""

    exit_code = 3


class LossSpikeError(RunStopped):
    """The loss or gradient norm stayed far above its running median: the run diverged."""

    exit_code = 3


class PeerError(RunStopped):
    """Another rank did not arrive at a collective, or the launcher is gone."""

    exit_code = 4
    same_on_every_rank = False  # each surviving rank reports what it saw


class DataWorkerError(PeerError):
    """A data-loading worker of this rank died, hung past the timeout or failed to read."""


class CheckpointWriteError(RunStopped):
    """A checkpoint could not be written; the partial folder was removed."""

    exit_code = 5


class Preempted(RunStopped):
    """A preemption signal arrived: the step finished and a checkpoint was saved."""

    exit_code = 75


class Interrupted(RunStopped):
    """Signal `signum` stopped the run and nothing was saved: exit code 128 + `signum`."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


def on_every_rank(error: UserError) -> UserError:
    """`error`, marked as one every rank raises alike: printed once, by rank 0 (`report`)."""
    error.same_on_every_rank = True  # type: ignore[attr-defined]
    return error


@contextlib.contextmanager
def decided_alike():
    """Around checks every rank makes alike: a `UserError` raised inside is marked
    `on_every_rank`, so it is printed once."""
    try:
        yield
    except UserError as e:
        on_every_rank(e)
        raise


def exit_on_user_error(fn: F) -> F:
    """Decorate a CLI `main`: a `UserError` prints `error: <message>` to stderr and exits 2; a
    `RunStopped` prints its message (`preempted: ...` for a preemption) and exits its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            _report(e, USER_ERROR_EXIT_CODE, rank0_first=True)
        except RunStopped as e:
            _report(e, e.exit_code)
        except KeyboardInterrupt:  # Ctrl-C before a run's own handling started, or after it
            _report(Interrupted("SIGINT (Ctrl-C): stopped at once; nothing was saved", SIGINT), 130)

    return wrapper  # type: ignore[return-value]


def report(error: Exception) -> None:
    """Print `error` as its one line now, once (rank 0 only for an error every rank raised).
    The guard calls it before the launcher's SIGTERM can stop this rank."""
    if getattr(error, "reported", False):
        return
    error.reported = True  # type: ignore[attr-defined]
    kind = "preempted" if isinstance(error, Preempted) else "error"
    same = getattr(error, "same_on_every_rank", False)
    rank, world = _rank_world()
    if rank == 0 or not same:
        where = f"[rank {rank}] " if world > 1 and not same else ""
        print(f"{kind}: {where}{error}", file=sys.stderr, flush=True)


def _report(error: Exception, code: int, rank0_first: bool = False) -> None:
    """Print `error` (`report`) and exit `code`; `rank0_first`: see `RANK0_GRACE_S`."""
    report(error)
    if rank0_first:
        (rank, world), same = _rank_world(), getattr(error, "same_on_every_rank", False)
        if same and rank != 0 and world > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(RANK0_GRACE_S)
    raise SystemExit(code) from None


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
