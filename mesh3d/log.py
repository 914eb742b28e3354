"""The one mesh3d logger, with Nanotron's line prefix and per-rank levels.

`setup_logging` runs once per process, every line prefixed like Nanotron CLASSIC:
`12/02/2026 12:00:00 [INFO|DP=0|PP=0|TP=0]: `. World rank 0 and the metrics-owning rank log at
`logging.log_level`, the other ranks (replicas) at `logging.log_level_replica`, with one
difference from Nanotron: a replica never logs below WARNING unless its level is `debug`, so
Nanotron's default `log_level_replica: info` prints the run's start lines once, not once per
rank. Code logs through `logger` and never checks ranks itself; the iteration line is only
emitted on the one rank that owns the metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

logger = logging.getLogger("mesh3d")


class _DropKnownNoise(logging.Filter):
    """Drops a third-party logger's records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_known_import_noise() -> None:
    """Silence the lines torchao's import prints on a machine its prebuilt kernels do not fit
    (a CPU build of torch, another Python): "Failed to load .../_C_*.so" per kernel file, the
    reason it skips them, and torch's deprecation note on its `register_constant` calls. They
    come on every `import transformers` when torchao is installed (the `float8` and `dev`
    extras) and say nothing about the run; torchao's float8 training does not use those
    kernels. Every other torchao and torch record still shows. Idempotent."""
    for name, noise in (
        ("torchao", _DropKnownNoise("Failed to load ", "Skipping import of cpp extensions")),
        ("torch.utils._pytree", _DropKnownNoise("%s is an Enum subclass")),
    ):
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in target.filters):
            target.addFilter(noise)


quiet_known_import_noise()

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": logging.CRITICAL + 10,  # Nanotron accepts it and then crashes; we log nothing
}


def setup_logging(coords: dict, level: str, cp: int = 1) -> None:
    """Configure `logger` for this process at `level`; `coords` holds its dp/pp/tp (and cp)
    coordinates; the prefix shows CP only when the run splits sequences (`cp` > 1).

    The caller picks the level: `logging.log_level` for world rank 0 and for the rank that
    owns the metrics (the last pipeline stage's dp 0 / tp 0 rank), `log_level_replica` for
    the others. On a replica rank (see `is_primary`) `info` and `warning` both mean WARNING;
    `debug` is kept, so a user who asks for every rank's details gets them.
    """
    cp_part = f"|CP={coords.get('cp', 0)}" if cp > 1 else ""
    prefix = f"DP={coords['dp']}{cp_part}|PP={coords['pp']}|TP={coords['tp']}"
    if os.environ.get("SLURMD_NODENAME"):
        prefix += f"|{os.environ['SLURMD_NODENAME']}"
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [%(levelname)s|{prefix}]: %(message)s", "%m/%d/%Y %H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(effective_level(level, is_primary(coords, *_world())))
    # DTensor warns on every 2-D (dp x tp) norm reduction that two collectives run; expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def setup_launcher_logging() -> None:
    """Show INFO lines in the process of `mesh3d train` before any rank exists (the default
    run's one-time data preparation), with the same prefix as a rank's lines, the launcher
    shown as `LAUNCHER`. A process whose logging is already set up keeps it."""
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter("%(asctime)s [%(levelname)s|LAUNCHER]: %(message)s", "%m/%d/%Y %H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)


@contextlib.contextmanager
def launcher_lines():
    """`setup_launcher_logging` for a block (a torchrun rank 0 showing what `mesh3d train`'s
    launcher shows before the run); afterwards the logger is as it was, unconfigured, until the
    run sets up the rank's own logging."""
    if logger.handlers:
        yield
        return
    setup_launcher_logging()
    try:
        yield
    finally:
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def effective_level(level: str, primary: bool) -> int:
    """The logging level of a rank: `level` on a primary rank; at least WARNING on a replica,
    unless `level` is `debug`."""
    n = _LEVELS[level]
    return n if primary or n == logging.DEBUG else max(n, logging.WARNING)


def is_primary(coords: dict, rank: int, world_size: int) -> bool:
    """World rank 0, or the dp 0 / tp 0 rank of the last pipeline rank, which owns the metrics
    (with the V schedules the last stage is on pipeline rank 0, and this rank logs as well).

    Ranks are numbered (pp, dp, cp, tp) with tp fastest, so pipeline rank p starts at world
    rank p * (dp * cp * tp): that rank is the last pipeline rank's when one more pipeline rank would reach
    the world size.
    """
    if rank == 0:
        return True
    if coords["dp"] or coords.get("cp", 0) or coords["tp"] or not coords["pp"]:
        return False
    per_pipeline_rank = rank // coords["pp"]
    return rank + per_pipeline_rank == world_size


def _world() -> tuple[int, int]:
    """(rank, world size): the process group's, else torchrun's environment, else one process."""
    dist = sys.modules.get("torch.distributed")  # never imports torch itself
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Progress:
    """Progress of long work that is not a training step (checkpoint save/load, data indexing).

    `update()` after each item logs `<what>: i/n (p%), <elapsed> s, eta <s> s` at most every
    `every_s` seconds; `done()` logs the total once. Quiet work (under `every_s`) logs one line.
    """

    def __init__(self, what: str, total: int, every_s: float = 10.0):
        import time

        self._clock = time.monotonic
        self.what, self.total, self.every_s = what, max(total, 1), every_s
        self.count, self.start = 0, self._clock()
        self._last = self.start

    def update(self, n: int = 1) -> None:
        self.count += n
        now = self._clock()
        if now - self._last >= self.every_s and self.count < self.total:
            self._last = now
            elapsed = now - self.start
            eta = elapsed / self.count * (self.total - self.count)
            logger.info(
                f"{self.what}: {self.count}/{self.total} ({100 * self.count / self.total:.0f}%), "
                f"{elapsed:.0f} s, eta {eta:.0f} s"
            )

    def done(self, detail: str = "") -> float:
        """Log the total time (and `detail`); returns the seconds taken."""
        elapsed = self._clock() - self.start
        logger.info(f"{self.what}: {self.count}/{self.total} done in {elapsed:.1f} s{detail}")
        return elapsed
