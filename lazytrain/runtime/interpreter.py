"""The interpreter: one handler per op kind (``handlers.py``, ``gradients.py``, ``updates.py``),
issued by a dependency-driven dispatcher.

The plan's contract (and the simulator's model): each resource (GPU, H2D, D2H, CPU, NVME) runs its
ops in list order, and an op starts when its resource is free and its dependencies (``op.deps``:
every hazard the plan has, ``ir.order``) are done.  The interpreter issues ops to match, from one
thread, without ever letting one resource's wait hold up another:

- every resource issues its ops FIFO (list order); ``free`` ops (no resource) issue as soon as they
  may;
- an op may be *issued* once every dependency has been issued: a stream waits on another stream's
  event on the device (``stream.wait_event``), a host worker waits inside the worker;
- an op issued from this thread that needs a host worker's result (a stream op after an ``update``
  or an NVMe read; a load after the previous step's same-step update, ``Schedule.carried``), or that
  reads the step's gradient norms (``Updates.takes_norm``), is issued only once those handles are
  *complete*, so the thread never blocks on them while other resources have work to issue;
- among the issuable heads the lowest op id goes first: when nothing waits, the issue order is the
  program order (allocations happen in the order ``verify`` checked); only when no head can be
  issued does the dispatcher block, until the first pending handle completes.

A failure names the op, as ``torch.fx.Interpreter`` does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait

from ..ir import Op, OpKind, Plan, Resource, Tier
from ..ir.kinds import COPY_KINDS
from ..ir.order import cross_period
from ..ir.semantics import Sizes
from ..ir.tiers import TIERS
from . import collectives as coll
from . import gpu_update as gu
from . import gradients as gr
from . import handlers as h
from .context import Step, describe
from .updates import Updates, update

#: the runtime's handler of each op kind (the runtime's column of the op registry, ``ir.kinds``, which sits below
#: it: a test checks every kind has one)
HANDLERS: dict[OpKind, Callable[[Step, Op], None]] = {
    OpKind.LOAD: h.load,
    OpKind.COMPUTE: h.compute,
    OpKind.RECOMPUTE: h.recompute,
    OpKind.BACKWARD: h.backward,
    OpKind.OFFLOAD: h.copy,
    OpKind.RELOAD: h.copy,
    OpKind.GRAD_OFFLOAD: gr.grad_offload,
    OpKind.UPDATE: update,
    OpKind.FREE: h.free,
    OpKind.ALL_GATHER: coll.all_gather,
    OpKind.REDUCE_SCATTER: coll.reduce_scatter,
    OpKind.ALL_REDUCE: coll.all_reduce,
    OpKind.STATE_LOAD: gu.state_load,
    OpKind.STATE_STORE: gu.state_store,
    OpKind.STATE_READ: h.state_read,
    OpKind.STATE_WRITE: h.state_write,
}


#: GPU-stream ops the host may issue ahead of the GPU.  Memory is allocated when an op is issued and a
#: freed block is reusable only once the stream has passed it, so the GPU memory ``verify`` counts in
#: program order holds only while the issuing thread stays close behind the stream: two ops in flight keep
#: the stream fed (each is a block's work for a micro-batch) and hold at most two of them beyond it.
MAX_AHEAD = 2


def run(ctx: Step) -> None:
    """Run the plan's ops for one step."""
    ops = ctx.run.plan.ops
    inflight: deque = deque()
    for op in dispatch(ctx, ops):
        try:
            HANDLERS[op.kind](ctx, op)
        except Exception as e:
            raise RuntimeError(f"while executing op #{op.id} ({describe(op)}): {e}") from e
        if op.resource is Resource.GPU:
            ev = ctx.done.get(op.id)
            if ev is not None and not isinstance(ev, Future):
                inflight.append(ev)
                while len(inflight) > MAX_AHEAD:
                    inflight.popleft().synchronize()


def _worker_tier(t: Tier | None) -> bool:
    """Are copies and frees on tier ``t`` done by a host worker (``ir.tiers.TierSpec.on_worker``: file I/O)?"""
    return t is not None and TIERS[t].on_worker


def on_worker(op: Op) -> bool:
    """Does the op run on a host worker (its completion handle is a ``Future``)?"""
    k = op.kind
    return ((k is OpKind.UPDATE and op.resource is not Resource.GPU) or op.resource is Resource.NVME
            or (k in COPY_KINDS and (_worker_tier(op.src) or _worker_tier(op.dst)))
            or (k is OpKind.FREE and _worker_tier(op.src)))


def _instant(op: Op) -> bool:
    """Issued and complete in one go on this thread, waiting for nothing (GPU and host frees)."""
    return op.kind is OpKind.FREE and not _worker_tier(op.src)


class Schedule:
    """What the dispatcher needs, computed once per plan from ``op.deps``: per op the ops it unblocks,
    its FIFO neighbours, the handles that must be complete before it is issued (``waits``: this step's;
    ``carried``: the previous step's host updates, ``ir.order.cross_period``)."""

    def __init__(self, plan: Plan, updates: Updates):
        ops = self.ops = plan.ops
        n = len(ops)
        if any(op.id != i for i, op in enumerate(ops)):
            raise ValueError("op ids must be 0..n-1 in list order")
        previous = cross_period(ops, Sizes.of_plan(plan), clip=bool(plan.options.get("clip", True)))
        #: per op, the previous step's worker ops it waits for (the rest of that step is done: ``Trainer.step``)
        self.carried: list[tuple[int, ...]] = [tuple(d for d in previous.get(i, ()) if on_worker(ops[d]))
                                               for i in range(n)]
        self.waits: list[tuple[int, ...]] = []
        for op in ops:
            if updates.takes_norm(op):       # the norm is read on this thread (every grad_offload done)
                self.waits.append(tuple(d for d in op.deps if ops[d].kind is OpKind.GRAD_OFFLOAD))
            elif on_worker(op) or _instant(op):
                self.waits.append(())
            else:
                self.waits.append(tuple(d for d in op.deps if on_worker(ops[d])))
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for op in ops:
            for d in op.deps:
                self.dependents[d].append(op.id)
        self.prev = [-1] * n          # previous op in the same FIFO (-1: first, or no FIFO)
        self.next = [-1] * n
        last: dict[Resource, int] = {}
        for op in ops:
            if op.resource is Resource.NONE:
                continue
            p = last.get(op.resource, -1)
            self.prev[op.id] = p
            if p >= 0:
                self.next[p] = op.id
            last[op.resource] = op.id
        self.n_deps = [len(op.deps) for op in ops]
        #: NVMe writes, reads and deletes: the step waits for them before it returns
        self.host_io = tuple(op.id for op in ops if on_worker(op) and op.kind is not OpKind.UPDATE)
        self.check = [bool(self.waits[i] or self.carried[i]) for i in range(n)]

    def pending(self, ctx: Step, i: int):
        """A handle op ``i`` must see complete before it is issued, or None."""
        done = ctx.done
        for d in self.waits[i]:
            x = done.get(d)
            if x is not None and not _complete(x):
                return x
        for d in self.carried[i]:
            f = ctx.run.updates.future(d)
            if f is not None and not f.done():
                return f
        return None


def _complete(x) -> bool:
    return x.done() if isinstance(x, Future) else x.query()


def dispatch(ctx: Step, ops: list[Op]) -> Iterator[Op]:
    """Yield the ops in an issue order that honours the rules above; the caller issues each one
    before asking for the next.  Blocks only when no head can be issued."""
    sched = ctx.run.schedule
    n = len(ops)
    missing = list(sched.n_deps)
    issued = bytearray(n)
    prev, nxt, dependents, check = sched.prev, sched.next, sched.dependents, sched.check
    ready = [i for i in range(n) if missing[i] == 0 and prev[i] < 0]
    heapq.heapify(ready)
    blocked: list[int] = []
    left = n
    while left:
        if blocked:
            still = []
            for i in blocked:
                if sched.pending(ctx, i) is None:
                    heapq.heappush(ready, i)
                else:
                    still.append(i)
            blocked = still
        if not ready:
            if not blocked:
                raise RuntimeError("dispatcher: no op can be issued (a dependency cycle in the plan)")
            _wait_first([sched.pending(ctx, i) for i in blocked])
            continue
        i = heapq.heappop(ready)
        if check[i] and sched.pending(ctx, i) is not None:
            blocked.append(i)
            continue
        yield ops[i]
        issued[i] = 1
        left -= 1
        k = nxt[i]
        if k >= 0 and missing[k] == 0:
            heapq.heappush(ready, k)
        for d in dependents[i]:
            missing[d] -= 1
            if missing[d] == 0 and (prev[d] < 0 or issued[prev[d]]):
                heapq.heappush(ready, d)


def _wait_first(handles: list) -> None:
    """Block until one of ``handles`` (futures of host workers, or CUDA events) is complete."""
    futs = [x for x in handles if isinstance(x, Future)]
    if futs:
        wait(futs, return_when=FIRST_COMPLETED)
    else:
        for x in handles:
            if x is not None:
                x.synchronize()
                return
