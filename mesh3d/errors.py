"""User-facing errors and the ways a run stops early, each with its own exit code.

Anything a user can get wrong (a config value, a missing file, a layout that does not fit the
world size) raises `UserError` or a subclass: exit code 2. A run that cannot or must not go on
raises a `RunStopped` subclass whose message says what happened, what was kept and what to do:

    code  exception              meaning
    0     -                      trained to tokens.train_steps
    2     UserError              a config, file or checkpoint that cannot be used as given
    3     NonFiniteError         the loss or gradient norm was NaN/inf; no update, nothing saved
    3     LossSpikeError         the loss or gradient norm spiked `mesh3d.loss_spike.max_skipped`
                                 + 1 steps in a row (`train/spike.py`); their updates not applied
    4     PeerError              a rank did not arrive (stopped, dead, hung) or the launcher died
    4     DataWorkerError        a data-loading worker process died, hung or failed (`data/loader.py`)
    5     CheckpointWriteError   a save could not be written (disk full, I/O error); the
                                 previous checkpoint is intact
    75    Preempted              SIGTERM/SIGUSR1/SIGINT: the step finished, a checkpoint was
                                 saved; launch the same command again to continue (EX_TEMPFAIL)
    128+N Interrupted            signal N stopped the run and nothing was saved: a second
                                 signal, Ctrl-C before training, or no checkpoints section
                                 (130 for SIGINT, 143 for SIGTERM, as a shell reports them)

Entry points catch them with `exit_on_user_error`: one `error: ...` line (printed once when every
rank raised the same error), no traceback, that exit code. So no exit code claims a save that did
not happen. Our own broken invariants stay `assert`s and keep their tracebacks.
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
# How long a rank but 0 waits before exiting with a user error every rank raised, under an elastic
# agent, which stops every rank once one exits: rank 0 prints first (its exit ends the wait)
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


class UserError(ValueError):
    """A mistake in what the user gave us; the message says what to change. Set
    `same_on_every_rank` on one that every rank raised alike (a config check, a decision shared
    by rank 0), so that only rank 0 prints it.

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
    """A training run that stopped before `tokens.train_steps`; `exit_code` tells a launcher
    (or a Slurm script) why. `same_on_every_rank`: every rank raises this very message."""

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
    """`error`, marked as one every rank raises alike (from the same config, files or a value
    one rank shared): printed once, by rank 0 (`report`)."""
    error.same_on_every_rank = True  # type: ignore[attr-defined]
    return error


@contextlib.contextmanager
def decided_alike():
    """Around checks every rank makes alike (the same config and files): a `UserError` raised
    inside is marked as every rank's (`on_every_rank`), so it is printed once."""
    try:
        yield
    except UserError as e:
        on_every_rank(e)
        raise


def exit_on_user_error(fn: F) -> F:
    """Decorate a CLI `main`: a `UserError` prints `error: <message>` to stderr and exits 2; a
    `RunStopped` prints its message (`preempted: ...` for a preemption) and exits its code.

    A message every rank raised alike is printed by rank 0 only (RANK from the launcher).
    """

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

    The guard calls it while its signal handlers still hold off the launcher's SIGTERM, which
    follows at once when a peer exits first; the entry point's decorator prints nothing twice.
    """
    if getattr(error, "reported", False):
        return
    error.reported = True  # type: ignore[attr-defined]
    kind = "preempted" if isinstance(error, Preempted) else "error"
    same = getattr(error, "same_on_every_rank", False)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or not same:
        where = f"[rank {rank}] " if world > 1 and not same else ""
        print(f"{kind}: {where}{error}", file=sys.stderr, flush=True)


def _report(error: Exception, code: int, rank0_first: bool = False) -> None:
    """Print `error` (`report`) and exit `code`; `rank0_first`: a user error, possibly raised
    before the run's guard, whose barrier otherwise lets rank 0 print before any rank leaves."""
    report(error)
    if rank0_first and _rank0_prints_it(error):
        time.sleep(RANK0_GRACE_S)
    raise SystemExit(code) from None


def _rank0_prints_it(error: Exception) -> bool:
    """An error every rank raised, on a rank but 0, under an elastic agent (which stops the
    others when one exits)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    same = getattr(error, "same_on_every_rank", False)
    return same and rank != 0 and world > 1 and "TORCHELASTIC_RUN_ID" in os.environ
