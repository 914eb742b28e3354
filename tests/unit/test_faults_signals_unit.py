"""The fault suite, part 3 (real launchers): Ctrl-C and preemption signals sent to what users
start, `mesh3d train` and `recipes/slurm/launch.py`, as a terminal or a scheduler sends them.
Each test asserts the exit code, the one line printed and what is on disk.

This file holds the tests of that subject that run in one process without a process group; the
others are in `tests/launch/test_faults_signals.py`."""

from __future__ import annotations

import os
import signal
import time

from mesh3d.train.signals import REPEAT_S, StopSignals


def test_a_signal_delivered_twice_or_repeated_by_a_scheduler_does_not_stop_the_save():
    """Under Slurm, srun and scancel signal every process of the step and torchrun forwards the
    signal again: each rank got SIGUSR1 twice within milliseconds, and the second one ended it
    before the save. Only a second SIGINT, a second or more after the first, stops at once."""
    seconds, codes = [], []
    own = os.getpid()
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under a shell's background job
    with StopSignals(
        on_first=lambda signum: None, on_second=seconds.append, exit=codes.append
    ) as sig:
        for signum in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGINT):  # within a second
            os.kill(own, signum)
            time.sleep(0.05)
        assert sig.received == signal.SIGUSR1 and seconds == [] and codes == []
        time.sleep(REPEAT_S)
        os.kill(own, signal.SIGTERM)  # a scheduler's repeat: its SIGKILL follows if it must
        time.sleep(0.05)
        assert seconds == [] and codes == []
        os.kill(own, signal.SIGINT)  # a person's second Ctrl-C
        deadline = time.monotonic() + 5
        while not codes and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seconds == [signal.SIGINT] and codes == [130]
    assert signal.getsignal(signal.SIGINT) is before  # restored
