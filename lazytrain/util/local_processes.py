"""Worker processes on this host that rendezvous over TCP: a free port for them, and joining them by a deadline.

``lazytrain profile`` measures the collectives in N spawned processes (``profile_collectives.py``) and the tests
run N-rank training the same way; both need a port nothing listens on and a join that cannot hang on a rank
that never ends.
"""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_all(procs, timeout: float) -> list[int | None]:
    """Exit codes of ``procs`` (None: killed) after at most ``timeout`` seconds in all; those still running then are
    killed and reaped.  The last process is joined first, so one that exits early is reaped at once."""
    end = time.monotonic() + timeout
    for p in reversed(procs):
        p.join(max(0.1, end - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes
