"""Choosing the CPU thread count of a training run by measuring it, not by guessing once.

On the CPU a step's speed depends on how many cores are free, and that changes: a 2-core machine
that was busy when the run started (an install finishing, another job) is often idle a minute
later, and the reverse.  One guess at start-up (``cpu_threads`` below: the cores idle then) can
leave half the machine unused for the whole run, or oversubscribe it (a spinning OpenMP thread that
waits for a descheduled sibling makes a step 2-3x slower).  ``ThreadTuner`` therefore tries each
thread count for a few steps, keeps the fastest, and tries again every ``every`` steps.  Probing
costs a few slow steps per round; the numbers of a run do not depend on it (thread counts change
reduction order, so losses agree to rounding, not bit for bit).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from ..util.host import cpu_cores


class ThreadTuner:
    """Call ``observe(step_seconds)`` after every step; it calls ``apply(n)`` when the count changes.

    A round tries ``1 .. max_threads`` in turn, ``probe`` steps each (the first ``settle`` steps
    after a change are not timed), keeps the count with the lowest median, and runs with it for
    ``every`` steps before the next round."""

    def __init__(self, max_threads: int, apply: Callable[[int], None], start: int | None = None,
                 probe: int = 12, settle: int = 2, every: int = 500):
        self.candidates = list(range(1, max(1, max_threads) + 1))
        self.apply, self.probe, self.settle, self.every = apply, probe, settle, every
        self.current = start if start in self.candidates else self.candidates[-1]
        self.history: list[tuple[int, dict[int, float]]] = []   # (step, {threads: median s}) per round
        self._steps = 0
        self._queue: list[int] = []
        self._times: dict[int, list[float]] = {}
        self._since_change = 0
        self._until_round = 0
        if len(self.candidates) > 1:
            self._start_round()

    def _start_round(self) -> None:
        # the current count first: no switch (and no settling) before its timings
        self._queue = [self.current] + [n for n in self.candidates if n != self.current]
        self._times = {n: [] for n in self.candidates}
        self._since_change = self.settle     # already settled on the current count

    def _switch(self, n: int) -> None:
        if n != self.current:
            self.current = n
            self.apply(n)
            self._since_change = 0

    def observe(self, step_s: float) -> None:
        self._steps += 1
        if not self._queue:                  # running with the chosen count
            self._until_round -= 1
            if self._until_round <= 0 and len(self.candidates) > 1:
                self._start_round()
            return
        n = self._queue[0]
        self._since_change += 1
        if self._since_change > self.settle:
            self._times[n].append(step_s)
        if len(self._times[n]) < self.probe:
            return
        self._queue.pop(0)
        if self._queue:
            self._switch(self._queue[0])
            return
        medians = {k: statistics.median(v) for k, v in self._times.items() if v}
        self.history.append((self._steps, medians))
        self._switch(min(medians, key=medians.get))
        self._until_round = self.every


def cpu_threads(window_s: float = 0.3) -> int:
    """Threads for this process: the cores that are idle now, at least one.

    On a busy machine more OpenMP threads than free cores is far slower, not faster: a thread that
    waits at a barrier for a descheduled sibling spins.  Measured on the shared 2-core machine at
    load ~5 with the task model at batch 32: 0.24-0.30 s/step with 1 thread, 0.75 s/step with 2.
    "Idle now" is the idle share of ``/proc/stat`` over ``window_s`` (the 1-minute load average,
    used where there is no ``/proc``, still counts work that ended a minute ago: it gave this
    process 1 thread on an idle 2-core machine right after another job).
    """
    cores = cpu_cores()
    busy = _busy_cores(window_s, cores)
    return max(1, min(cores, cores - round(busy)))


def _busy_cores(window_s: float, cores: int) -> float:
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)     # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(window_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    machine_cores = os.cpu_count() or cores
    return max(0.0, machine_cores * (1 - (i1 - i0) / max(1, t1 - t0)) - (machine_cores - cores))
