"""Streams and completion handles: how an op's ``deps`` become waits.

One compute stream, one H2D and one D2H stream (``docs/architecture.md``, "The runtime"), plus two host workers (CPU for
``update``, NVME for file I/O), each running its ops in list order (FIFO), as the plan assumes.

Every op leaves a *completion handle* in ``handlers.Step.done[op.id]``:

- a ``torch.cuda.Event`` recorded on its stream right after its work was enqueued (GPU resources),
- a ``concurrent.futures.Future`` (host workers), or
- ``None``: already complete (CPU mode, where streams are no-ops and work runs synchronously, and
  ``free``).

Waiting depends on who waits on what: a stream waits on an event with ``stream.wait_event`` (no
host stall); a stream op that needs a host worker's result is issued by the dispatcher
(``interpreter.dispatch``) only once that future is complete, so ``future.result()`` here returns at
once (or re-raises the worker's error); a host worker waits on an event with ``event.synchronize()``
inside the worker, so the issuing thread keeps going.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..ir import Resource


class Streams:
    """The three CUDA streams (or nothing, in CPU mode) and the two host workers."""

    def __init__(self, device: torch.device, collectives: bool = False):
        """``collectives``: a fourth stream for the collective ops (a world of several ranks)."""
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self._by_res = {Resource.GPU: self.compute, Resource.H2D: self.h2d, Resource.D2H: self.d2h}
            if collectives:
                self._by_res[Resource.NET] = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = None
            self._by_res = {}
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-update")
        self.nvme = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-nvme")

    def stream(self, res: Resource):
        return self._by_res.get(res)

    def on(self, res: Resource):
        """Context that makes ``res``'s stream current (allocations then belong to it)."""
        s = self._by_res.get(res)
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def record(self, res: Resource, timing: bool = False):
        """An event after everything enqueued so far on ``res`` (None in CPU mode)."""
        s = self._by_res.get(res)
        if s is None:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(s)
        return ev

    def wait_on_stream(self, res: Resource, handles) -> None:
        """Make stream ``res`` wait for ``handles`` (events: on the device; futures: on the host, now)."""
        s = self._by_res.get(res)
        for h in handles:
            if h is None:
                continue
            if isinstance(h, Future):
                h.result()
            elif s is not None:
                s.wait_event(h)
            else:                     # a host-side wait from the issuing thread
                h.synchronize()

    @staticmethod
    def wait_on_host(handles) -> None:
        """Block the calling thread until ``handles`` are complete (for host workers)."""
        for h in handles:
            if h is None:
                continue
            if isinstance(h, Future):
                h.result()
            else:
                h.synchronize()

    def keep_alive(self, t: torch.Tensor, res: Resource) -> None:
        """``t`` is read on ``res``'s stream: the allocator must not reuse its memory before that read
        completes, even after the last Python reference is dropped (``Tensor.record_stream``)."""
        s = self._by_res.get(res)
        if s is not None and t.device.type == "cuda":
            t.record_stream(s)

    def synchronize(self) -> None:
        """Wait for all work on the device (one host sync, at the end of a step)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.cpu.shutdown(wait=True)
        self.nvme.shutdown(wait=True)
