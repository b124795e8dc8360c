"""The search's deadline, counted in the CPU time the compile gets, with a wall-clock backstop.

A deadline in wall time makes the plan depend on the machine's load: on 2 cores shared with other work (a
load of 4 to 8), the MILP search of the compile grid stopped early in 15 rows and gave slower plans, and the
3B compiled-blocks compiles ended on the megatrain plan.  Counted in CPU time -- this process's
(``time.process_time``) plus the solver workers' (``isolated.solver_cpu_seconds``), which the compile waits
on -- the same inputs get the same work done and so the same plan whatever else runs.  A starved machine
must still answer: the wall-clock backstop is ``isolated.WALL_FACTOR`` times the deadline, and the plan's
``SolverStats.deadline_clock`` says which of the two stopped the search.

Not counted: other threads of this process add to ``process_time`` (a compile in a thread beside others
gets less than its deadline, never more).
"""

from __future__ import annotations

import time

from .solvers import isolated


def compile_cpu_seconds() -> float:
    """CPU seconds this process and its solver workers have spent so far."""
    return time.process_time() + isolated.solver_cpu_seconds()


class Deadline:
    """``seconds`` of CPU time from ``start()`` (none when ``seconds`` is None), and ``WALL_FACTOR`` times
    that in wall time.  ``stopped_by`` records the clock that ran out first ("cpu" or "wall").

    ``reserve``: CPU seconds of the deadline kept for the work after the search (the GPU-update rule,
    ``compiler/gpu_update.py``): the search's own clocks end that much earlier, and ``after_cpu_left`` says
    what is left to the whole deadline."""

    def __init__(self, seconds: float | None, reserve: float = 0.0):
        self.seconds = seconds
        self.reserve = reserve if seconds is not None else 0.0
        self._cpu_end = self._wall_end = float("inf")
        #: the longest a check of a solution (a plan's build) took so far, in CPU and wall seconds: what a
        #: solve must leave time for
        self.build_cpu = self.build_wall = 0.0
        self.stopped_by = ""
        #: the clock that bounds the next solve's limit as ``solve_limit`` last cut it
        self.binding = "cpu"

    def start(self) -> None:
        """Start counting (a new question of the caller's)."""
        if self.seconds is not None:
            search_s = self.search_seconds()
            self._cpu_end = compile_cpu_seconds() + search_s
            self._wall_end = time.monotonic() + isolated.WALL_FACTOR * search_s
        self.stopped_by = ""

    def search_seconds(self) -> float | None:
        """CPU seconds of the deadline that are the search's (None without a deadline)."""
        return None if self.seconds is None else self.seconds - self.reserve

    def after_cpu_left(self) -> float:
        """CPU seconds left to the whole deadline, the reserve included (infinite without a deadline)."""
        return self._cpu_end + self.reserve - compile_cpu_seconds()

    def cpu_left(self) -> float:
        """CPU seconds to the deadline once the slowest build so far is set aside (infinite without one)."""
        return self._cpu_end - compile_cpu_seconds() - self.build_cpu

    def wall_left(self) -> float:
        """Wall seconds to the backstop once the slowest build so far is set aside."""
        return self._wall_end - time.monotonic() - self.build_wall

    def solve_limit(self, limit: float) -> float:
        """``limit`` (CPU seconds of one solve) cut so that the solve and one build end by the deadline and,
        were it to run at the slowest rate the backstop allows, by the backstop."""
        cpu, wall = self.cpu_left(), self.wall_left() / isolated.WALL_FACTOR
        self.binding = "wall" if wall < cpu else "cpu"
        return min(limit, cpu, wall)

    def has(self, seconds: float) -> bool:
        """Is there time for ``seconds`` of CPU and a build on both clocks?  No: record which clock ran out."""
        if self.cpu_left() < seconds:
            self.stopped_by = self.stopped_by or "cpu"
            return False
        if self.wall_left() < seconds:
            self.stopped_by = self.stopped_by or "wall"
            return False
        return True

    def timed(self, cpu0: float, wall0: float) -> None:
        """Note a build that started at ``cpu0`` (``compile_cpu_seconds``) and ``wall0`` (``time.perf_counter``)."""
        self.build_cpu = max(self.build_cpu, compile_cpu_seconds() - cpu0)
        self.build_wall = max(self.build_wall, time.perf_counter() - wall0)
