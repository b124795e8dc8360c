"""Test helper: ``within(seconds)`` fails a block that runs longer (a hang becomes a failure, not a stuck CI)."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def within(seconds: float):
    """Raise TimeoutError in the block after ``seconds`` (SIGALRM: main thread, Python code)."""
    def alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
