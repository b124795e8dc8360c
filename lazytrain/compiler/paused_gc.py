"""Python's cyclic garbage collector paused while a plan is built.

A build makes ~10 small objects per op (the op, its effects, their tuples, the hazards), all acyclic: reference
counting frees them.  The op list being built survives young collections, so the collector promotes it and,
every so many collections, walks every object of the process in a full one: ~0.1 s in a process that has
imported torch, a large share of a build [ledger: paused-gc].  The collector runs again when the build returns
(or raises)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The collector off for the block, and back on after it if it was on before (nested uses and a caller that
    turned it off themselves are left as they were)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
