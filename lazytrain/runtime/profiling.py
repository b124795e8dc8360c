"""Measured timeline of one step (``Trainer(profile=True)``).

GPU-resource ops are bracketed by timing ``torch.cuda.Event``s recorded on their stream (the start
event after the stream's waits, so queueing is not counted as work); host-worker ops (update, NVMe)
by ``time.perf_counter`` inside the worker.  Both clocks are put on one axis by a reference event
recorded right after the device is idle at the start of the step.  In CPU mode every op is timed
with ``perf_counter`` (it runs synchronously).

Figures (``StepProfile``):

- ``hidden[kind]`` for load / offload / reload / grad_offload: the fraction of that kind's busy
  time that overlaps GPU compute (compute, recompute, backward) — 1.0 means fully hidden;
- ``exposed_update_s``: host update time *not* overlapped by GPU compute (``update_s`` all of it);
  ``device_update_s``: resident blocks' updates, run on the GPU stream (GPU work, never hidden);
- ``busy_s[resource]`` and the trace: (op id, resource, start_s, end_s) per measured op;
- ``memory``: (time_s, bytes) samples of the device memory in use over the step.  On CUDA,
  ``torch.cuda.memory_allocated`` (the caching allocator's view: every live tensor on the device,
  whoever owns it, without the allocator's cached free blocks) read right after each GPU-resource op
  has been issued, so it includes that op's outputs, and placed at the op's measured start; a first
  sample at 0 is what was allocated when the step began.  A host-side read, no synchronisation.  In
  CPU mode there is no device allocator to ask: the samples come from ``runtime.memtrack`` (its live
  device bytes after each op's handler, at the time it returned) when the step runs under
  ``memtrack.track(trainer)``, and the curve is empty otherwise.  Transients inside an op (freed
  before it returns) are not seen.

Nothing here runs unless profiling is on (``Step.profiler`` is None otherwise).  ``StepProfile.save``
writes versioned JSON that names the plan it was measured on (``plan_digest``) so a trace is never
drawn from another plan's profile (``StepProfile.check``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..ir import Op, OpKind, Plan, Resource

PROFILE_FORMAT = "lazytrain.profile/1"

TRANSFERS = (OpKind.LOAD, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.GRAD_OFFLOAD)
COMPUTE = (OpKind.COMPUTE, OpKind.RECOMPUTE, OpKind.BACKWARD)


def plan_digest(plan: Plan) -> str:
    """Names one plan: its model's fingerprint, batch, sequence length and op list."""
    d = {"model": plan.fingerprint, "batch": plan.batch_size, "seq": plan.seq_len,
         "ops": [op.to_json() for op in plan.ops]}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class StepProfile:
    step_s: float
    hidden: dict[str, float]
    transfer_s: dict[str, float]
    exposed_update_s: float
    update_s: float
    busy_s: dict[str, float]
    trace: list[tuple[int, str, float, float]] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)
    plan: dict | None = None          # {"model", "digest", "n_ops"} of the plan measured, once saved with it
    #: resident blocks' updates on the GPU stream: GPU work, so never hidden (not in the two above)
    device_update_s: float = 0.0

    @property
    def update_exposed_fraction(self) -> float:
        """Exposed update time (host updates not under compute, plus GPU updates) over all update time."""
        total = self.update_s + self.device_update_s
        return (self.exposed_update_s + self.device_update_s) / total if total > 0 else 0.0

    def to_json(self, plan: Plan | None = None) -> dict:
        """Versioned JSON; with ``plan``, it records which plan was measured (``check`` reads it)."""
        info = self.plan if plan is None else {"model": plan.graph.name, "digest": plan_digest(plan),
                                               "n_ops": len(plan.ops)}
        return {"format": PROFILE_FORMAT, "plan": info, "step_s": self.step_s, "hidden": self.hidden,
                "transfer_s": self.transfer_s, "exposed_update_s": self.exposed_update_s,
                "update_s": self.update_s, "device_update_s": self.device_update_s,
                "busy_s": self.busy_s, "trace": [list(t) for t in self.trace],
                "memory": [list(m) for m in self.memory]}

    @staticmethod
    def from_json(d: dict) -> StepProfile:
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"not a lazytrain step profile (format {got!r}, expected {PROFILE_FORMAT!r}): "
                             "write one with StepProfile.save after a step with Trainer(profile=True)")
        try:
            return StepProfile(step_s=float(d["step_s"]), hidden=dict(d["hidden"]), transfer_s=dict(d["transfer_s"]),
                               exposed_update_s=float(d["exposed_update_s"]), update_s=float(d["update_s"]),
                               busy_s=dict(d["busy_s"]),
                               trace=[(int(i), str(r), float(a), float(b)) for i, r, a, b in d["trace"]],
                               memory=[(float(t), int(n)) for t, n in d.get("memory") or []],
                               plan=None if d.get("plan") is None else dict(d["plan"]),
                               device_update_s=float(d.get("device_update_s", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed step profile: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path, plan: Plan) -> None:
        Path(path).write_text(json.dumps(self.to_json(plan)))

    @staticmethod
    def load(path: str | Path) -> StepProfile:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise OSError(f"cannot read profile {path}: {e.strerror or e}") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"profile {path} is not valid JSON: {e}") from None
        try:
            return StepProfile.from_json(d)
        except ValueError as e:
            raise ValueError(f"profile {path}: {e}") from None

    def check(self, plan: Plan) -> None:
        """Raise ``ValueError`` unless this profile was measured on ``plan``: the digest it was saved
        with, or (none saved) every measured op is one of the plan's, on the same resource."""
        if self.plan is not None and self.plan.get("digest") is not None:
            if self.plan["digest"] != plan_digest(plan):
                raise ValueError(f"the profile was measured on another plan (model {self.plan.get('model')}, "
                                 f"{self.plan.get('n_ops')} ops, digest {self.plan['digest']}) than this one "
                                 f"(model {plan.graph.name}, {len(plan.ops)} ops, digest {plan_digest(plan)})")
            return
        n = len(plan.ops)
        for i, res, _, _ in self.trace:
            if not 0 <= i < n or plan.ops[i].resource.value != res:
                raise ValueError(f"the profile does not fit this plan ({n} ops): its op #{i} ran on {res}, "
                                 + ("which the plan does not have" if not 0 <= i < n
                                    else f"the plan's runs on {plan.ops[i].resource.value}"))


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
        self._mem: list[tuple[int, float | None, int]] = []    # (op id, host time or None: its start, bytes)
        self.t0 = time.perf_counter()
        self.ref = None
        if self.cuda:
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.t0 = time.perf_counter()
            self._mem.append((-1, self.t0, torch.cuda.memory_allocated()))

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
            self._mem.append((op.id, None, torch.cuda.memory_allocated(stream.device)))

    def sample(self, op: Op, nbytes: int) -> None:
        """Device bytes in use just after ``op``'s handler returned (CPU mode: ``memtrack`` calls it)."""
        self._mem.append((op.id, time.perf_counter(), nbytes))

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
        starts = {i: a for i, _, a, _ in trace}
        memory = sorted(((starts[i] if t is None else t - self.t0, n) for i, t, n in self._mem
                         if t is not None or i in starts), key=lambda m: m[0])
        kind = {i: self._ops[i].kind for i, *_ in trace}
        comp = _union([(a, b) for i, _, a, b in trace if kind[i] in COMPUTE])
        hidden, tsum = {}, {}
        for k in TRANSFERS:
            iv = [(a, b) for i, _, a, b in trace if kind[i] is k]
            tot = sum(b - a for a, b in iv)
            tsum[k.value] = tot
            hidden[k.value] = (sum(_overlap(a, b, comp) for a, b in iv) / tot) if tot > 0 else 1.0
        # host updates hide under GPU compute or are exposed; a resident block's update is GPU work itself
        upd = [(a, b) for i, res, a, b in trace if kind[i] is OpKind.UPDATE and res != Resource.GPU.value]
        dev_upd = sum(b - a for i, res, a, b in trace if kind[i] is OpKind.UPDATE and res == Resource.GPU.value)
        busy: dict[str, float] = {}
        for _, res, a, b in trace:
            busy[res] = busy.get(res, 0.0) + (b - a)
        return StepProfile(step_s=step_s, hidden=hidden, transfer_s=tsum,
                           exposed_update_s=sum((b - a) - _overlap(a, b, comp) for a, b in upd),
                           update_s=sum(b - a for a, b in upd), busy_s=busy, trace=trace, memory=memory,
                           device_update_s=dev_upd)
