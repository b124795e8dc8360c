"""Measured timeline of one step (``Trainer(profile=True)``).

GPU-resource ops are bracketed by timing ``torch.cuda.Event``s recorded on their stream (the start
event after the stream's waits, so queueing is not counted as work); host-worker ops (update, NVMe)
by ``time.perf_counter`` inside the worker.  Both clocks are put on one axis by a reference event
recorded right after the device is idle at the start of the step.  In CPU mode every op is timed
with ``perf_counter`` (it runs synchronously).

Figures (``StepProfile``):

- ``hidden[kind]`` for load / offload / reload / grad_offload: the fraction of that kind's busy
  time that overlaps GPU compute (compute, recompute, backward) — 1.0 means fully hidden;
- ``exposed_update_s``: update time *not* overlapped by GPU compute;
- ``busy_s[resource]`` and the trace: (op id, resource, start_s, end_s) per measured op.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..ir import Op, OpKind

TRANSFERS = (OpKind.LOAD, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.GRAD_OFFLOAD)
COMPUTE = (OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD)


@dataclass
class StepProfile:
    step_s: float
    hidden: dict[str, float]
    transfer_s: dict[str, float]
    exposed_update_s: float
    update_s: float
    busy_s: dict[str, float]
    trace: list[tuple[int, str, float, float]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "hidden": self.hidden, "transfer_s": self.transfer_s,
                "exposed_update_s": self.exposed_update_s, "update_s": self.update_s, "busy_s": self.busy_s,
                "trace": [list(t) for t in self.trace]}


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(a: float, b: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


class Profiler:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._lock = threading.Lock()
        self.begin_step()

    def begin_step(self) -> None:
        self._gpu: dict[int, list] = {}
        self._host: dict[int, tuple[float, float]] = {}
        self._ops: dict[int, Op] = {}
        self.t0 = time.perf_counter()
        self.ref = None
        if self.cuda:
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.t0 = time.perf_counter()

    def start(self, op: Op, stream) -> None:
        self._ops[op.id] = op
        if stream is None:
            self._host[op.id] = (time.perf_counter(), 0.0)
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self._gpu[op.id] = [ev, None]

    def stop(self, op: Op, stream) -> None:
        if stream is None:
            self._host[op.id] = (self._host[op.id][0], time.perf_counter())
        else:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self._gpu[op.id][1] = ev

    def host_interval(self, op: Op, t0: float, t1: float) -> None:
        with self._lock:
            self._ops[op.id] = op
            self._host[op.id] = (t0, t1)

    def finish(self, step_s: float) -> StepProfile:
        """Call after the step's work is complete (the trainer synchronizes first)."""
        trace = []
        for i, (a, b) in self._host.items():
            trace.append((i, self._ops[i].resource.value, a - self.t0, b - self.t0))
        for i, (ea, eb) in self._gpu.items():
            trace.append((i, self._ops[i].resource.value, self.ref.elapsed_time(ea) / 1e3,
                          self.ref.elapsed_time(eb) / 1e3))
        trace.sort(key=lambda t: (t[2], t[0]))
        kind = {i: self._ops[i].kind for i, *_ in trace}
        comp = _union([(a, b) for i, _, a, b in trace if kind[i] in COMPUTE])
        hidden, tsum = {}, {}
        for k in TRANSFERS:
            iv = [(a, b) for i, _, a, b in trace if kind[i] is k]
            tot = sum(b - a for a, b in iv)
            tsum[k.value] = tot
            hidden[k.value] = (sum(_overlap(a, b, comp) for a, b in iv) / tot) if tot > 0 else 1.0
        upd = [(a, b) for i, _, a, b in trace if kind[i] is OpKind.UPDATE]
        busy: dict[str, float] = {}
        for _, res, a, b in trace:
            busy[res] = busy.get(res, 0.0) + (b - a)
        return StepProfile(step_s=step_s, hidden=hidden, transfer_s=tsum,
                           exposed_update_s=sum((b - a) - _overlap(a, b, comp) for a, b in upd),
                           update_s=sum(b - a for a, b in upd), busy_s=busy, trace=trace)
