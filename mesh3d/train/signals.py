"""The stop signals of a run: the first means "finish the step, save, exit 75"; a second
SIGINT, `REPEAT_S` or more later, exits at once (sooner, it is torchrun forwarding the first
again). Python runs handlers in the main thread, which a collective can block for minutes, so
a thread reads the signals from the wakeup fd instead."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_S = 1.0


class StopSignals:
    """Handles `STOP_SIGNALS` while entered (main thread only; elsewhere it does nothing).

    Example:

        with StopSignals(on_first=print, on_second=lambda signum: None) as signals:
            ...
            if signals.received: save(); raise Preempted(...)
    """

    def __init__(self, on_first: Callable[[int], None], on_second: Callable[[int], None],
                 exit: Callable[[int], None] = os._exit):  # fmt: skip
        """`exit(code)` ends the process after `on_second` (tests pass their own)."""
        self.on_first, self.on_second, self._exit = on_first, on_second, exit
        self.received: int | None = None
        self._first_at = 0.0
        self._previous: dict = {}
        self._wakeup = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers live in the main thread; a library caller keeps its own
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer, previous_fd)
        for sig in STOP_SIGNALS:  # a Python-level handler makes the interpreter write the fd
            self._previous[sig] = signal.signal(sig, _ignore)
        self._thread = threading.Thread(target=self._watch, name="mesh3d-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            reader, writer, previous_fd = self._wakeup
            signal.set_wakeup_fd(previous_fd)
            writer.close()  # the thread reads the end of the stream and returns
            self._thread.join(timeout=5)
            reader.close()
            self._wakeup = None

    def _watch(self) -> None:
        reader = self._wakeup[0]
        numbers = {int(s) for s in STOP_SIGNALS}
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:  # the writer closed
                return
            for signum in data:
                if signum in numbers:
                    self._arrived(signum)

    def _arrived(self, signum: int) -> None:
        if self.received is None:
            self.received, self._first_at = signum, time.monotonic()
            self.on_first(signum)
            return
        if signum != signal.SIGINT or time.monotonic() - self._first_at < REPEAT_S:
            return  # delivered twice, or a scheduler's repeat (see the module doc)
        try:
            self.on_second(signum)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            self._exit(128 + signum)


def _ignore(signum, frame) -> None:
    """The main thread's part: nothing (the watching thread acts on the wakeup fd)."""
