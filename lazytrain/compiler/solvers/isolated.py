"""Solve a ``LinearModel`` in a child process, so that a solver library that crashes, hangs or answers
garbage costs at most that solve, never the caller's process.

One long-lived worker per solver (``solver_worker.py``, a script that imports only mip) serves every
solve of this process: it starts once (~0.3 s) and a compile's many small solves pay no start-up.
A solve is tried on each solver of ``order`` in turn; a failure is

- a crash (the worker exits: a signal such as SIGSEGV, or an abort),
- a hang (no answer within the time limit plus ``GRACE_S``: the worker is killed),
- garbage (an answer that is not JSON, or a solution that violates the model's bounds or rows),
- an error inside the worker (a missing library, a bad model).

``infeasible`` and ``no_solution`` (nothing found in time) are answers, not failures.  When every
solver fails, ``SolverFailure`` carries what happened to each, for the caller's one warning.

A solve's ``time_limit`` counts the worker's CPU time (``solver_worker.py``), so that a loaded machine does not
change what a solve finds; ``WALL_FACTOR`` times it in wall time is the backstop that ends a starved solve.
The CPU seconds the workers spent are summed in ``solver_cpu_seconds()``: the compile's deadline counts them
with its own process's (``compiler/deadline.py``); the workers live on, so the operating system's figures for
finished children do not hold them.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .lp import LinearModel

#: solvers in the order tried when the caller names none: HiGHS first (no crash in the grid of
#: ``benchmarks/solver_grid.py``, where CBC crashed or was slower; see its results table)
DEFAULT_ORDER = ("highs", "cbc")
SOLVERS = ("highs", "cbc")
#: seconds past a solve's wall backstop before its worker counts as hung [ledger: solver-wall-factor]
GRACE_S = 5.0
#: wall seconds a solve may take per CPU second of its limit (4x oversubscribed) [ledger: solver-wall-factor]
WALL_FACTOR = 4.0
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "solver_worker.py")


@dataclass
class SolveResult:
    status: str                      # optimal | feasible | infeasible | no_solution
    objective: float | None
    gap: float | None
    x: list[float] | None
    seconds: float
    solver: str
    #: CPU seconds the worker spent on it (what its time limit counts)
    cpu_s: float = 0.0
    #: what went wrong on the solvers tried before this one ("cbc crashed (SIGSEGV)")
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("optimal", "feasible")


class SolverFailure(RuntimeError):
    """Every solver failed on one model; ``failures`` says how, one line each."""

    def __init__(self, failures: list[str]):
        super().__init__("; ".join(failures))
        self.failures = failures


class _Worker:
    """One solver process and its pipes.  Not thread-safe on its own: ``_lock`` serialises use."""

    def __init__(self, command: list[str]):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     start_new_session=True)
        self.buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: dict, timeout: float) -> dict:
        """Send one request; the decoded answer, or raise ``_Failed`` naming what went wrong."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _Failed(self._death()) from None
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    raise _Failed(f"hung (no answer {timeout:.0f} s after it started; killed)")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise _Failed(self._death())
                self.buffer += chunk
        finally:
            sel.close()
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            out = json.loads(line)
        except ValueError:
            self.kill()
            raise _Failed(f"answered garbage ({line[:60]!r})") from None
        if not isinstance(out, dict):
            raise _Failed(f"answered garbage ({line[:60]!r})")
        return out

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            try:
                why = signal.Signals(-code).name
            except ValueError:
                why = f"signal {-code}"
        else:
            why = f"exit status {code}"
        return f"crashed ({why}{stderr_tail(self.stderr)})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.stderr.close()


class _Failed(Exception):
    pass


def stderr_tail(f) -> str:
    """": LAST LINE" of a child's captured stderr (``f``, a binary temporary file), or "" where it wrote none."""
    try:
        f.seek(0)
        lines = [s for s in f.read().decode(errors="replace").splitlines() if s.strip()]
    except (OSError, ValueError):
        return ""
    return f": {lines[-1].strip()[:120]}" if lines else ""


_lock = threading.Lock()
_workers: dict[str, _Worker] = {}
_cpu = [0.0]        # CPU seconds the workers spent on this process's solves (``solver_cpu_seconds``)


def solver_cpu_seconds() -> float:
    """CPU seconds the solver workers spent on this process's solves so far; a solve whose worker died or hung
    counts its wall seconds (it did not say, and at most that much was spent)."""
    return _cpu[0]


def worker_command() -> list[str]:
    """The command that starts a solver process (a test may point it at a program that crashes)."""
    return [sys.executable, "-s", WORKER]


def _worker(solver: str) -> _Worker:
    w = _workers.get(solver)
    if w is None or not w.alive():
        if w is not None:
            w.close()
        w = _workers[solver] = _Worker(worker_command())
    return w


def prestart(solver: str) -> None:
    """Start ``solver``'s process now, so that its start-up (Python, then mip and the solver's library,
    ~0.3 s) runs on another core while the caller traces the model, not before the first solve."""
    if solver in SOLVERS:
        with _lock:
            _worker(solver)


@atexit.register
def shutdown() -> None:
    """Stop the solver processes (also at interpreter exit)."""
    with _lock:
        for w in _workers.values():
            w.close()
        _workers.clear()


def solve(model: LinearModel, *, order: tuple[str, ...] = DEFAULT_ORDER, time_limit: float, gap: float,
          cuts: int | None = None) -> SolveResult:
    """Solve ``model`` on the first solver of ``order`` that answers soundly, in ``time_limit`` CPU seconds."""
    data = model.to_json()
    failures: list[str] = []
    wall_limit = WALL_FACTOR * time_limit
    for solver in order:
        request = {"solver": solver, "model": data, "time_limit": time_limit, "wall_limit": wall_limit, "gap": gap,
                   "cuts": cuts}
        t0 = time.perf_counter()
        with _lock:
            try:
                out = _worker(solver).ask(request, wall_limit + GRACE_S)
            except _Failed as e:
                _cpu[0] += time.perf_counter() - t0
                failures.append(f"{solver} {e}")
                continue
            cpu_s = out.get("cpu_s")
            cpu_s = float(cpu_s) if isinstance(cpu_s, (int, float)) and cpu_s >= 0 else time.perf_counter() - t0
            _cpu[0] += cpu_s
        if out.get("status") == "error":
            failures.append(f"{solver} failed ({out.get('error', 'no reason given')})")
            continue
        status = out.get("status")
        x = out.get("x")
        if status in ("optimal", "feasible"):
            bad = model.check(x) if isinstance(x, list) else "no solution values"
            if bad is not None:
                failures.append(f"{solver} returned an invalid solution ({bad})")
                continue
        elif status not in ("infeasible", "no_solution", "unbounded"):
            failures.append(f"{solver} answered an unknown status {status!r}")
            continue
        return SolveResult(status=status, objective=out.get("objective"), gap=out.get("gap"), x=x,
                           seconds=time.perf_counter() - t0, solver=solver, failures=failures,
                           cpu_s=cpu_s)
    raise SolverFailure(failures)
