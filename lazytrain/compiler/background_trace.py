"""A preset's first compile (or a config.json's that is a preset's): the search runs on the preset's seed while
the real trace runs on another core.

A compile must trace its model before it can search, and on a fresh machine the trace of a preset costs
~3.5 s on 2 cores, nearly all of it importing torch, ``torch.export`` and transformers: a 7-8B model's first
compile took 7-8 s where its cached ones take 3.  The seed (``frontend/seed_traces.py``) predicts the
preset's graph without torch, so the compile searches on that prediction while ``frontend/trace_worker.py``
traces the model in a child process (and stores the trace in the cache).  The plan is returned only once
the child's graph is found equal to the prediction; where it is not (another torch or transformers than the
seed's), the compile runs again on the traced graph; where the child fails, the compile traces in its own
process, as it would have without a seed.  Either way the plan is the one the traced graph gives.

Only where the trace would cost its imports: a process that has torch already (a training script, a test
suite) traces in under a second itself, and a machine of one core would run the two one after the other.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from ..frontend import seed_traces
from ..frontend.preset_configs import PRESETS
from ..frontend.presets import read_config
from ..frontend.trace_cache import TraceCache
from ..ir.graph import ModelGraph
from ..util.host import cpu_cores
from . import pipeline
from .progress import log
from .solvers.isolated import stderr_tail

#: CPUs the process may run on for the seed to be worth a second process
MIN_CPUS = 2
#: seconds the child may take to answer before it counts as hung (killed; the compile traces itself): 300
#: [ledger: background-trace-timeout]
TRACE_TIMEOUT_S = 300.0
#: seconds a child that answered may take to exit before it is killed
EXIT_WAIT_S = 5.0
#: set while a compile whose background trace failed traces in its own process (no second child)
_tracing_here = contextvars.ContextVar("tracing_here", default=False)


def worker_command() -> list[str]:
    """The command that runs the trace (a test may point it at a program that fails)."""
    return [sys.executable, "-m", "lazytrain.frontend.trace_worker"]


def imports_pending() -> bool:
    """Would tracing in this process import torch first (what the seed saves)?"""
    return "torch" not in sys.modules


class BackgroundTrace:
    """The trace of one request running in a child process; ``predicted``: the seed's graph meanwhile."""

    def __init__(self, request: dict, predicted: ModelGraph):
        self.predicted = predicted
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.why_failed = ""
        self.answered = False
        root = str(Path(__file__).resolve().parent.parent.parent)      # the folder lazytrain is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env)
        self.proc.stdin.write(json.dumps(request).encode())
        self.proc.stdin.close()

    def result(self) -> ModelGraph | None:
        """The traced graph, once the child is done; None where it failed (``why_failed`` says how)."""
        left = TRACE_TIMEOUT_S - (time.perf_counter() - self.t0)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = left > 0 and sel.select(left)
        self.seconds = time.perf_counter() - self.t0
        if not ready:
            self.why_failed = f"no answer in {TRACE_TIMEOUT_S:g} s (killed)"
            self.proc.kill()
            return None
        out = self.proc.stdout.readline()          # the answer is one line; the child exits right after it
        self.answered = True
        try:
            answer = json.loads(out)
            if "graph" in answer:
                self.seconds = float(answer.get("seconds", self.seconds))     # the child's own, start-up aside
                return ModelGraph.from_json(answer["graph"])
            self.why_failed = str(answer.get("error", "no graph"))
        except (ValueError, TypeError, KeyError, AttributeError):
            self.why_failed = f"exit status {self.proc.wait()}{stderr_tail(self.stderr)}"
        return None

    def close(self) -> None:
        """Reap the child once it answered (it exits right after); stop it if it did not (the compile was
        interrupted, or failed before it asked)."""
        try:
            self.proc.wait(timeout=EXIT_WAIT_S if self.answered else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


def seed_of(model: str) -> str | None:
    """The preset whose seed predicts ``model``'s graph: ``model`` itself, or for a ``config.json`` (or a folder
    holding one) the preset whose every field it has with the same value (the published config of a model a
    preset copies: the fields it adds, such as token ids or ``torch_dtype``, do not shape the graph, and where
    one does, the trace says so); else None."""
    if model in PRESETS:
        return model
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        cfg = read_config(path)
    except ValueError:
        return None                 # the compile's own checks say what is wrong with it
    return next((name for name, preset in PRESETS.items() if all(k in cfg and cfg[k] == v
                                                                  for k, v in preset.items())), None)


def start(model, *, seq_len, dtype: str, packed: bool, seq_tile, compile_blocks: bool,
          check=lambda: None) -> BackgroundTrace | None:
    """The background trace of ``model`` with its seed's graph, or None where the compile should trace as
    before: no seed for the model (``seed_of``) or these arguments, a trace in the cache, torch already imported,
    one CPU, or no transformers to build a Hugging Face model with (the compile's own trace says so).  ``check``
    runs before the child starts: what it raises (a mistaken profile or size) is said at once, not after the
    trace a seeded compile waits for."""
    if (not isinstance(model, str) or packed or seq_tile is not None or compile_blocks
            or not isinstance(seq_len, int) or _tracing_here.get() or not imports_pending() or cpu_cores() < MIN_CPUS):
        return None
    name = seed_of(model)
    if name is None:
        return None
    if PRESETS[name]["model_type"] != "lazytrain-gpt" and importlib.util.find_spec("transformers") is None:
        return None
    cache = TraceCache.of(model, seq_len=seq_len, dtype=dtype, packed=False, seq_tile=None)
    if cache is not None and cache.load() is not None:
        return None
    predicted = seed_traces.predict(name, seq_len, dtype)
    if predicted is None:
        return None
    check()
    try:
        bg = BackgroundTrace({"model": model, "seq_len": seq_len, "dtype": dtype, "packed": False, "seq_tile": None},
                             predicted)
    except OSError:             # no process to be had (no interpreter to start, a limit on processes)
        return None
    log.info("tracing %s at %s tokens in another process; searching meanwhile on %s", model, f"{seq_len:,}",
             "its built-in trace" if name == model else f"the built-in trace of {name}")
    return bg


def compile_seeded(model: str, bg: BackgroundTrace, req):
    """The plan of ``req`` searched on ``bg``'s seed: its plan where the traced graph equals the seed's, else the
    traced graph's (module docstring).  An error the seed's search raised (no plan fits) is raised only once the
    traced graph confirms it."""
    t0 = time.perf_counter()
    try:
        # its warnings too are the caller's only once the trace confirms the graph
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plan, error = pipeline.checked_run(bg.predicted, req), None
            except Exception as e:  # noqa: BLE001 - authoritative only once the trace confirms the graph
                plan, error = None, e
        real = bg.result()
        if real is None:
            log.info("the background trace failed (%s): tracing here", bg.why_failed)
            token = _tracing_here.set(True)
            try:
                plan = pipeline.checked_run(model, req)
            finally:
                _tracing_here.reset(token)
            return _noted(plan, {"seed": "trace failed", "why": bg.why_failed})
        if not seed_traces.same_graph(real, bg.predicted):
            log.info("the built-in trace of %s differs from this installation's: searching again on the traced "
                     "graph", model)
            return _noted(pipeline.checked_run(real, req), {"seed": "differed", "seconds": round(bg.seconds, 4)}, t0)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if error is not None:
            raise error
        graph = dataclasses.replace(plan.graph, meta={**plan.graph.meta, "trace_seconds": real.meta.get(
            "trace_seconds")})
        return _noted(dataclasses.replace(plan, graph=graph), {"seed": "matched", "seconds": round(bg.seconds, 4)},
                      t0)
    finally:
        bg.close()


def _noted(plan, trace_pass: dict, t0: float | None = None):
    """``plan`` with the background trace in its history (first, where a trace pass goes), and its total
    counted from ``t0`` (the wait for the child included)."""
    history = [{"pass": "trace", "background": True, **trace_pass}, *plan.history]
    if t0 is not None:
        history = [{**h, "seconds": round(time.perf_counter() - t0, 4)} if h.get("pass") == "total" else h
                   for h in history]
    plan.history = history
    return plan
