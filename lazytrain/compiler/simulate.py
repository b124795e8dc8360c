"""Event simulation of an op list: predicted step time, busy time per resource, the timeline.

Each resource (GPU stream, H2D, D2H, host CPU, NVMe, and with several ranks the collective stream) runs
its ops in list order; an op starts when its resource is free and its dependencies (``op.deps``,
nothing else) have finished.  The plan
is one period of a steady state, so the simulation runs several periods back to back, adding the
dependencies that cross a period boundary (``ir.order.cross_period``), and reports the last period:
its duration is the step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Plan, Resource, TensorKind, Tier
from ..ir.order import cross_period
from ..ir.semantics import Effects, Sizes, effects


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


def simulate(plan: Plan, periods: int = 3, effs: list[Effects] | None = None, sizes: Sizes | None = None) -> SimResult:
    """The plan's timeline over ``periods`` steps; ``effs``: each op's ``effects`` where the caller has
    them (for the memory curve), else computed here; ``sizes``: the caller's ``Sizes``, used where they equal
    the plan's (``Sizes.of_plan``)."""
    ops = plan.ops
    n = len(ops)
    sizes = Sizes.of_plan(plan, like=sizes)
    extra = cross_period(ops, sizes, clip=bool(plan.options.get("clip", True)))
    free_at = {r: 0.0 for r in Resource}
    prev_end: list[float] = [0.0] * n
    period_end = [0.0]
    # the ops' fields as plain lists (op ids are positions, ``verify._check_ids``): the loop below runs
    # periods x ops times, ~10^5 for a 72-micro-batch plan of 80 blocks
    none = Resource.NONE
    resource = [op.resource for op in ops]
    deps = [op.deps for op in ops]
    seconds = [op.seconds for op in ops]
    cross = [extra.get(i, ()) for i in range(n)]
    for p in range(periods):
        end = [0.0] * n
        start = [0.0] * n
        for i in range(n):
            r = resource[i]
            t = free_at[r] if r is not none else 0.0
            for d in deps[i]:
                e = end[d]
                if e > t:
                    t = e
            if p > 0:
                for d in cross[i]:
                    e = prev_end[d]
                    if e > t:
                        t = e
            start[i] = t
            end[i] = e = t + seconds[i]
            if r is not none:
                free_at[r] = e
        period_end.append(max(end) if n else 0.0)
        prev_end = end
        last_start, last_end = start, end
    step = period_end[-1] - period_end[-2]
    t0 = period_end[-2]
    # the collective stream appears only in a plan that uses it (a world of one has no collectives)
    busy = {r.value: 0.0 for r in Resource if r is not Resource.NONE
            and (r is not Resource.NET or plan.world_size > 1)}
    name = {r: r.value for r in Resource}
    for r, s in zip(resource, seconds):
        if r is not none:
            busy[name[r]] += s
    gpu_idle = max(0.0, step - busy["gpu"])
    mem = _memory_curve(plan, last_start, last_end, t0, effs, sizes)
    return SimResult(step_time_s=step, busy_s=busy, exposed_transfer_s=gpu_idle, gpu_idle_s=gpu_idle,
                     start=[s - t0 for s in last_start], end=[e - t0 for e in last_end], memory=mem,
                     peak_gpu_bytes=max((b for _, b in mem), default=0))


def predicted_gpu_peak(rep, sim: SimResult) -> int:
    """The GPU peak a plan predicts from its ops: the higher of ``verify``'s walk in op order (``rep``) and the
    timeline's (``sim``).  The runtime allocates as it issues ops in list order, so a buffer listed before an op
    that frees another is allocated while that one is still held, even where the timeline runs the freeing op
    first (a GPU-updated block's update dropping its gradients while an earlier-listed load waits for the
    copy engine); the timeline holds what overlaps in time on several streams.  The compiler stores this
    figure and ``lazytrain show`` checks a file's against it."""
    return max(rep.peak_gpu_bytes, sim.peak_gpu_bytes)


def _memory_curve(plan: Plan, start: list[float], end: list[float], t0: float, effs: list[Effects] | None,
                  sizes: Sizes) -> list[tuple[float, int]]:
    """GPU bytes over time: an op's GPU outputs are allocated when it starts, drops released when
    it ends (what a stream-ordered allocator sees)."""
    if effs is None:
        effs = [effects(op, sizes) for op in plan.ops]
    events: list[tuple[float, int]] = []
    seen_grads: set[int] = set()
    gpu, grads = Tier.GPU, TensorKind.GRADS      # enum members as locals: a member read off its class is slow
    for op, eff in zip(plan.ops, effs):
        i = op.id
        for t, tier in eff.writes:
            if tier is gpu:
                if t.kind is grads:
                    if t.index in seen_grads:
                        continue
                    seen_grads.add(t.index)
                events.append((start[i], sizes.of(t, tier)))
        if eff.transient:
            events.append((start[i], eff.transient))
            events.append((end[i], -eff.transient))
        for t, tier in eff.drops:
            if tier is gpu:
                events.append((end[i], -sizes.of(t, tier)))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = sizes.resident_bytes() + sizes.kept_grad_bytes()
    curve = []
    for t, d in events:
        cur += d
        curve.append((t - t0, cur))
    return curve
