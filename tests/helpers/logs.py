"""The messages mesh3d's logger gets while a function runs (tests of what a run says)."""

from __future__ import annotations

import logging

from mesh3d.log import logger


def logged(fn) -> tuple[list[str], object]:
    """(the messages logged at INFO and above while `fn()` runs, what `fn()` returned)."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        out = fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return seen, out
