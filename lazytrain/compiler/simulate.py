"""Event simulation of an op list: predicted step time, busy time per resource, the timeline.

Each resource (GPU stream, H2D, D2H, host CPU, NVMe) runs its ops in list order; an op starts
when its resource is free and its dependencies have finished.  The plan is one period of a
steady state, so the simulation runs several periods back to back, adding the dependencies that
cross a period boundary (a lagged update waits for last period's gradients -- with exact clipping
for all of them and the end of the backward, since it needs the global norm; a parameter load
waits for its block's update of the period before), and reports the last period: its duration
is the step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import OpKind, Plan, Resource, Tier
from ..ir.semantics import Sizes, effects


@dataclass
class SimResult:
    step_time_s: float
    busy_s: dict[str, float]
    exposed_transfer_s: float
    gpu_idle_s: float
    start: list[float] = field(repr=False)      # per op, last period, relative to its start
    end: list[float] = field(repr=False)
    memory: list[tuple[float, int]] = field(repr=False)   # (time, GPU bytes) in the last period
    peak_gpu_bytes: int = 0


def _cross_period_deps(plan: Plan) -> dict[int, list[int]]:
    """op id -> ids in the *previous* period it must wait for."""
    ops = plan.ops
    grad_off = {op.block: op.id for op in ops if op.kind is OpKind.GRAD_OFFLOAD}
    update = {op.block: op.id for op in ops if op.kind is OpKind.UPDATE}
    readers: dict[int, list[int]] = {}
    for b in plan.graph.blocks:
        for p in b.params:
            readers.setdefault(p.owner, [])
            if b.index not in readers[p.owner]:
                readers[p.owner].append(b.index)
    extra: dict[int, list[int]] = {}
    resident = plan.decisions.resident_blocks
    # with exact clipping a lagged update needs the global norm: the whole of last step's backward
    # and gradient offloads (the runtime takes it once the step's device work is done)
    step_end = [op.id for op in ops if op.kind in (OpKind.GRAD_OFFLOAD, OpKind.BACKWARD)]
    clip = bool(plan.options.get("clip", True))
    for owner, u in update.items():
        if owner in resident:          # on the GPU stream, after last step's clip coefficient
            extra[u] = step_end if clip else list(grad_off.values())
            continue
        gs = [grad_off[r] for r in readers.get(owner, [owner]) if r in grad_off]
        if gs and all(g > u for g in gs):          # lagged: needs last period's gradients
            extra.setdefault(u, []).extend(step_end if clip else gs)
        elif gs:                                   # same step: next period's loads wait for it
            for op in ops:
                if op.kind is OpKind.LOAD and any(p.owner == owner for p in plan.graph.blocks[op.block].params):
                    extra.setdefault(op.id, []).append(u)
                    break
    return extra


def simulate(plan: Plan, periods: int = 3) -> SimResult:
    ops = plan.ops
    n = len(ops)
    extra = _cross_period_deps(plan)
    free_at = {r: 0.0 for r in Resource}
    prev_end: list[float] = [0.0] * n
    period_end = [0.0]
    for p in range(periods):
        end = [0.0] * n
        start = [0.0] * n
        for op in ops:
            t = free_at[op.resource] if op.resource is not Resource.NONE else 0.0
            for d in op.deps:
                t = max(t, end[d])
            if p > 0:
                for d in extra.get(op.id, ()):
                    t = max(t, prev_end[d])
            start[op.id] = t
            end[op.id] = t + op.seconds
            if op.resource is not Resource.NONE:
                free_at[op.resource] = end[op.id]
        period_end.append(max(end) if n else 0.0)
        prev_end = end
        last_start, last_end = start, end
    step = period_end[-1] - period_end[-2]
    t0 = period_end[-2]
    busy = {r.value: 0.0 for r in Resource if r is not Resource.NONE}
    for op in ops:
        if op.resource is not Resource.NONE:
            busy[op.resource.value] += op.seconds
    gpu_idle = max(0.0, step - busy["gpu"])
    mem = _memory_curve(plan, last_start, last_end, t0)
    return SimResult(step_time_s=step, busy_s=busy, exposed_transfer_s=gpu_idle, gpu_idle_s=gpu_idle,
                     start=[s - t0 for s in last_start], end=[e - t0 for e in last_end], memory=mem,
                     peak_gpu_bytes=max((b for _, b in mem), default=0))


def _memory_curve(plan: Plan, start: list[float], end: list[float], t0: float) -> list[tuple[float, int]]:
    """GPU bytes over time: an op's GPU outputs are allocated when it starts, drops released when
    it ends (what a stream-ordered allocator sees)."""
    sizes = Sizes.of_plan(plan)
    events: list[tuple[float, int]] = []
    seen_grads: set[int] = set()
    for op in plan.ops:
        eff = effects(op, sizes)
        for t, tier in eff.writes:
            if tier is Tier.GPU:
                if t.kind.value == "grads":
                    if t.index in seen_grads:
                        continue
                    seen_grads.add(t.index)
                events.append((start[op.id], sizes.of(t, tier)))
        if eff.transient:
            events.append((start[op.id], eff.transient))
            events.append((end[op.id], -eff.transient))
        for t, tier in eff.drops:
            if tier is Tier.GPU:
                events.append((end[op.id], -sizes.of(t, tier)))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = sizes.resident_bytes()
    curve = []
    for t, d in events:
        cur += d
        curve.append((t - t0, cur))
    return curve
