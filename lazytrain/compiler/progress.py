"""What a compile is doing, said as it goes: a compile takes seconds (a 70B model's up to ~15 on 2 cores, a model's
first compile ~4 s more to trace it), which a command that prints nothing until it ends makes look hung.

The compiler says each stage on the ``lazytrain.compile`` logger at INFO: the trace (where it is not cached), the
heuristics' best plan and the micro-batches the MILP is solved at, each one's result, the GPU-update rule's choice.
A library caller sees nothing unless they configure logging; ``lazytrain compile`` and ``lazytrain train`` show the
lines on stderr where stderr is a terminal (``on_stderr``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

log = logging.getLogger("lazytrain.compile")
#: where the compile runs: the compiler, the calibration that wraps it, and the package's ``lazytrain.compile``
_PACKAGE = Path(os.path.abspath(__file__)).parent.parent
_COMPILING = (str(_PACKAGE / "compiler") + os.sep, str(_PACKAGE / "measure" / "calibrate.py"),
              str(_PACKAGE / "__init__.py"))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by this function's caller at the compile's caller: the first
    frame outside the compile (``_COMPILING``), however deep in the pipeline and its outer searches it arose -- the
    user's call of ``lazytrain.compile``, or the CLI's command (which shows LazyTrain's warnings as one line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_COMPILING):
        frame, level = frame.f_back, level + 1
    return level


@contextlib.contextmanager
def shown_on(stream: TextIO, prefix: str = "") -> Iterator[None]:
    """The compile's progress lines on ``stream``, each after ``prefix``, for the block (the logger as it was after
    it: a later compile in the same process does not write to a stream its caller may have closed)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def on_stderr(prefix: str, mode: str = "auto") -> contextlib.AbstractContextManager:
    """``shown_on`` stderr for ``mode`` "on", or "auto" where stderr is a terminal (a log file gets the command's
    summary only); nothing for "off"."""
    if mode == "on" or (mode == "auto" and sys.stderr.isatty()):
        return shown_on(sys.stderr, prefix)
    return contextlib.nullcontext()
