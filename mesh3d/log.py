"""The one mesh3d logger, with Nanotron's line prefix and per-rank levels.

Lines look like Nanotron CLASSIC's: `12/02/2026 12:00:00 [INFO|DP=0|PP=0|TP=0]: `. Unlike
Nanotron, a replica rank never logs below WARNING unless its level is `debug`, so the default
`log_level_replica: info` prints the run's start lines once, not once per rank.
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
    """Silence the lines torchao's import prints where its prebuilt kernels do not fit ("Failed
    to load .../_C_*.so", why it skips them) and torch's note on its `register_constant` calls:
    they come on every `import transformers` with torchao installed. Idempotent."""
    for name, noise in (
        ("torchao", _DropKnownNoise("Failed to load ", "Skipping import of cpp extensions")),
        ("torch.utils._pytree", _DropKnownNoise("%s is an Enum subclass")),
    ):
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in target.filters):
            target.addFilter(noise)


quiet_known_import_noise()

_LEVELS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error")}
_LEVELS["critical"] = logging.CRITICAL
_LEVELS["passive"] = logging.CRITICAL + 10  # Nanotron accepts it and then crashes; we log nothing


def setup_logging(coords: dict, level: str, cp: int = 1) -> None:
    """Configure `logger` for this process at `level` (see `effective_level`); `coords` holds
    its dp/pp/tp (and cp) coordinates; the prefix shows CP only when `cp` > 1."""
    cp_part = f"|CP={coords.get('cp', 0)}" if cp > 1 else ""
    prefix = f"DP={coords['dp']}{cp_part}|PP={coords['pp']}|TP={coords['tp']}"
    if os.environ.get("SLURMD_NODENAME"):
        prefix += f"|{os.environ['SLURMD_NODENAME']}"
    _handle(prefix)
    logger.setLevel(effective_level(level, is_primary(coords, *_world())))
    # DTensor warns on every 2-D (dp x tp) norm reduction that two collectives run; expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def setup_launcher_logging() -> None:
    """Show INFO lines in the process of `mesh3d train` before any rank exists, prefixed
    `LAUNCHER`. A process whose logging is already set up keeps it."""
    if logger.handlers:
        return
    _handle("LAUNCHER")
    logger.setLevel(logging.INFO)


def _handle(prefix: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [%(levelname)s|{prefix}]: %(message)s", "%m/%d/%Y %H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False


@contextlib.contextmanager
def launcher_lines():
    """`setup_launcher_logging` for a block; afterwards the logger is unconfigured again."""
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
    """World rank 0, or the dp 0 / tp 0 rank of the last pipeline rank, which owns the metrics.
    Pipeline rank p starts at world rank p * (dp * cp * tp), so it is the last when one more
    would reach the world size."""
    if rank == 0:
        return True
    if coords["dp"] or coords.get("cp", 0) or coords["tp"] or not coords["pp"]:
        return False
    return rank + rank // coords["pp"] == world_size


def _world() -> tuple[int, int]:
    """(rank, world size): the process group's, else torchrun's environment, else one process."""
    dist = sys.modules.get("torch.distributed")  # never imports torch itself
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Progress:
    """Progress of long work that is not a training step: `update()` after each item logs
    `<what>: i/n (p%), ...` at most every `every_s` seconds; `done()` logs the total once."""

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
