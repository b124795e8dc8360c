"""Device-memory accounting in CPU mode: what the runtime really holds on the "GPU", op by op.

``track(trainer)`` wraps the interpreter's handlers and runs them under a ``TorchDispatchMode`` that
sees every tensor the handlers create on the calling thread.  A *new* storage (one that is not an
input's: views, ``copy_`` and out= variants share an input's) is counted until a weakref finalizer
on it says it died.  Host buffers (``HostPool`` acquisitions, the host store) are not device
memory and are excluded; work on the host workers (the optimizer, NVMe I/O) runs on other threads,
which the mode (thread-local) does not see.

Per op it records the live device bytes before, the peak inside (transients), and after, so the
run compares with ``ir.verify(plan).gpu_curve`` op by op (``compare``); a profiled step also gets the
"after" figures as its memory curve (``StepProfile.memory``).  On a GPU the same numbers are what
``torch.cuda.max_memory_allocated`` would show, less allocator rounding and the deferred reuse of blocks
read on another stream (``record_stream``), which compile's reserve covers.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ir import Op, Tier
from ..ir.semantics import Sizes, effects
from ..ir.verify import verify
from . import interpreter


@dataclass
class OpMemory:
    op: Op
    before: int
    peak: int
    after: int


@dataclass
class DeviceMemory:
    """Live device bytes, their peak, and per-op records."""

    live: dict = field(default_factory=dict)          # storage ptr -> bytes
    host: set = field(default_factory=set)            # storage ptrs that are host buffers
    current: int = 0
    peak: int = 0
    op_peak: int = 0
    records: list[OpMemory] = field(default_factory=list)
    sizes: dict = field(default_factory=dict)         # ptr -> (bytes, op id, aten op) for reports
    op_id: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, st: torch.UntypedStorage, what: str) -> None:
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr == 0 or n == 0 or ptr in self.live or ptr in self.host:
            return
        with self.lock:
            self.live[ptr] = n
            self.sizes[ptr] = (n, self.op_id, what)
            self.current += n
            self.peak = max(self.peak, self.current)
            self.op_peak = max(self.op_peak, self.current)
        weakref.finalize(st, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        with self.lock:
            n = self.live.pop(ptr, 0)
            self.sizes.pop(ptr, None)
            self.current -= n
            self.host.discard(ptr)

    def mark_host(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        with self.lock:
            n = self.live.pop(ptr, None)
            if n is not None:
                self.current -= n
                self.sizes.pop(ptr, None)
            self.host.add(ptr)
        weakref.finalize(t.untyped_storage(), self._drop, ptr)


class _Mode(TorchDispatchMode):
    def __init__(self, mem: DeviceMemory, device: torch.device):
        super().__init__()
        self.mem, self.device = mem, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and t.layout is torch.strided}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type and t.layout is torch.strided:
                st = t.untyped_storage()
                if st.data_ptr() not in ins:
                    self.mem.add(st, str(func))
        return out


@contextlib.contextmanager
def track(trainer):
    """Within the block, ``trainer.step`` records device memory per op; yields the ``DeviceMemory``."""
    mem = DeviceMemory()
    ctx = trainer.ctx
    saved_handlers = dict(interpreter.HANDLERS)
    pool = ctx.pool
    acquire = pool.acquire

    def host_acquire(nbytes, *a, **kw):
        buf = acquire(nbytes, *a, **kw)
        mem.mark_host(buf)
        return buf

    cuda = trainer.device.type == "cuda"

    def wrap_cuda(fn):       # on a GPU: the allocator's figures, one op at a time (synchronised)
        def run(c, op):
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
            before = torch.cuda.memory_allocated(trainer.device)
            try:
                fn(c, op)
                torch.cuda.synchronize(trainer.device)
            finally:        # an op that runs out of memory is recorded too: its peak is where it stopped
                mem.records.append(OpMemory(op=op, before=before, peak=torch.cuda.max_memory_allocated(trainer.device),
                                            after=torch.cuda.memory_allocated(trainer.device)))
        return run

    def wrap(fn):
        def run(c, op):
            mem.op_id = op.id
            with mem.lock:
                before = mem.current
                mem.op_peak = before
            fn(c, op)
            mem.records.append(OpMemory(op=op, before=before, peak=mem.op_peak, after=mem.current))
            mem.op_id = -1
            if c.profiler is not None:      # a profiled step's memory curve (profiling.StepProfile.memory)
                c.profiler.sample(op, mem.current)
        return run

    for k, fn in saved_handlers.items():
        interpreter.HANDLERS[k] = wrap_cuda(fn) if cuda else wrap(fn)
    if not cuda:
        pool.acquire = host_acquire
    try:
        with contextlib.nullcontext() if cuda else _Mode(mem, trainer.device):
            yield mem
    finally:
        interpreter.HANDLERS.update(saved_handlers)
        pool.acquire = acquire


@dataclass(frozen=True)
class OpCompare:
    op: Op
    predicted_after: int
    predicted_peak: int      # before the op + what it writes + its transient (verify's peak rule)
    measured_after: int
    measured_peak: int
    predicted_before: int
    measured_before: int

    @property
    def transient_excess(self) -> int:
        """How far the op's measured transient (its peak above the larger of the memory before and after it)
        exceeds the predicted one; what was live before the step cancels out."""
        measured = self.measured_peak - max(self.measured_before, self.measured_after)
        return measured - (self.predicted_peak - max(self.predicted_before, self.predicted_after))


def compare(plan, mem: DeviceMemory, base: int = 0) -> list[OpCompare]:
    """Measured (less ``base``, what was live before the step) against verify's curve, per op."""
    rep = verify(plan)
    sizes = Sizes.of_plan(plan)
    by_id = {r.op.id: r for r in mem.records}
    out, prev = [], 0
    for op, after in zip(plan.ops, rep.gpu_curve):
        eff = effects(op, sizes)
        peak = prev + sum(sizes.of(t, tier) for t, tier in eff.writes if tier is Tier.GPU) + eff.transient
        r = by_id.get(op.id)
        if r is not None:
            out.append(OpCompare(op, after, max(peak, after), r.after - base, r.peak - base, prev, r.before - base))
        prev = after
    return out
