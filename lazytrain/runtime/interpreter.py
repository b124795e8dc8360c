"""The interpreter: one handler per op kind (``handlers.py``, ``gradients.py``), issued by a
dependency-driven dispatcher.

The plan's contract (and the simulator's model): each resource (GPU, H2D, D2H, CPU, NVME) runs its
ops in list order, and an op starts when its resource is free and its dependencies are done.  The
interpreter issues ops to match, from one thread, without ever letting one resource's wait hold up
another:

- every resource issues its ops FIFO (list order); ``free`` ops (no resource) issue as soon as they
  may;
- an op may be *issued* once every dependency has been issued: a stream waits on another stream's
  event on the device (``stream.wait_event``), a host worker waits inside the worker;
- an op issued from this thread that needs a host worker's result (a stream op after an ``update``
  or an NVMe read; a ``load`` after its block's update, even one of the previous step) is issued
  only once that future is *complete*, so the thread never blocks on it while other resources have
  work to issue;
- among the issuable heads the lowest op id goes first: when nothing waits, the issue order is the
  program order (allocations happen in the order ``verify`` checked); only when no head can be
  issued does the dispatcher block, until the first pending future completes.

Dependencies are the plan's ``deps`` plus the *hazards* on each value (``ir.semantics.effects``):
read after write, write after read or drop, across resources.  Lowering derives the first kind;
the others are implicit in program order (a reload of ``act[i]`` to the GPU must follow the
``free`` of its forward copy; a ``grad_offload`` overwrites the host gradient a lagged ``update``
still reads; a ``load`` copies the buffer its owner's ``update`` writes), and must be explicit once
resources issue independently.  A failure names the op, as ``torch.fx.Interpreter`` does.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from ..ir import Op, OpKind, Resource, Tier
from ..ir.semantics import Sizes, effects
from . import gradients as gr
from . import handlers as h
from .handlers import Ctx

HANDLERS: dict[OpKind, Callable[[Ctx, Op], None]] = {
    OpKind.LOAD: h.load,
    OpKind.COMPUTE: h.compute,
    OpKind.RECOMPUTE: h.recompute,
    OpKind.BACKWARD: h.backward,
    OpKind.OFFLOAD: h.offload,
    OpKind.RELOAD: h.reload,
    OpKind.GRAD_OFFLOAD: gr.grad_offload,
    OpKind.UPDATE: gr.update,
    OpKind.FREE: h.free,
}


#: GPU-stream ops the host may issue ahead of the GPU.  Memory is allocated when an op is issued and
#: a freed block is reusable only once the stream has passed it, so an issuing thread that runs far
#: ahead (a first step, with no lagged update to wait for) holds the outputs of many blocks at once:
#: seen as an out-of-memory on a 36-layer model whose plan peaked at 13 GiB.  Two in flight keep
#: the stream fed (each op is a block's work for a micro-batch) and memory as ``verify`` counted it.
MAX_AHEAD = 2


def run(ctx: Ctx, ops: Sequence[Op]) -> None:
    inflight: deque = deque()
    for op in dispatch(ctx, ops):
        try:
            HANDLERS[op.kind](ctx, op)
        except Exception as e:
            raise RuntimeError(f"while executing op #{op.id} ({h.describe(op)}): {e}") from e
        if op.resource is Resource.GPU:
            ev = ctx.done.get(op.id)
            if ev is not None and not isinstance(ev, Future):
                inflight.append(ev)
                while len(inflight) > MAX_AHEAD:
                    inflight.popleft().synchronize()


def on_worker(op: Op) -> bool:
    """Does the op run on a host worker (its completion handle is a ``Future``)?"""
    k = op.kind
    return ((k is OpKind.UPDATE and op.resource is not Resource.GPU) or (k is OpKind.OFFLOAD and op.dst is Tier.NVME)
            or (k in (OpKind.RELOAD, OpKind.FREE) and op.src is Tier.NVME))


def _instant(op: Op) -> bool:
    """Issued and complete in one go on this thread, waiting for nothing (GPU and host frees)."""
    return op.kind is OpKind.FREE and op.src is not Tier.NVME


class Schedule:
    """What the dispatcher needs, computed once per plan: per op its dependencies (``deps``: the
    plan's plus hazards, what handlers wait for), the ops it unblocks, its FIFO neighbours, and the
    worker ops whose futures must be complete before it is issued."""

    def __init__(self, ctx: Ctx, ops: Sequence[Op]):
        self.ops = ops
        n = len(ops)
        if any(op.id != i for i, op in enumerate(ops)):
            raise ValueError("op ids must be 0..n-1 in list order")
        plan = ctx.plan
        sizes = Sizes.of_plan(plan)
        owners = [sorted({o for _, o, _ in lay.links} | {j}) for j, lay in enumerate(ctx.store.layouts)]
        self.deps = _with_hazards(ops, sizes, owners)
        grad_offloads = tuple(op.id for op in ops if op.kind is OpKind.GRAD_OFFLOAD)
        self.waits: list[tuple[int, ...]] = []
        self.owners: list[tuple[int, ...]] = []
        for op in ops:
            if op.kind is OpKind.UPDATE and op.resource is not Resource.GPU and not ctx.lagged.get(op.block, False) \
                    and ctx.norm_first:
                # finish_norm reads every block's gradient norm on this thread
                self.deps[op.id] = tuple(sorted(set(self.deps[op.id]) | {g for g in grad_offloads if g < op.id}))
                self.waits.append(tuple(g for g in grad_offloads if g < op.id))
            elif on_worker(op) or _instant(op):
                self.waits.append(())
            else:
                self.waits.append(tuple(d for d in self.deps[op.id] if on_worker(ops[d])))
            self.owners.append(tuple(owners[op.block]) if op.kind is OpKind.LOAD else ())
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for i, ds in enumerate(self.deps):
            for d in ds:
                self.dependents[d].append(i)
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
        self.n_deps = [len(ds) for ds in self.deps]
        #: NVMe writes, reads and deletes: the step waits for them before it returns
        self.host_io = tuple(op.id for op in ops if on_worker(op) and op.kind is not OpKind.UPDATE)
        self.check = [bool(self.waits[i] or self.owners[i]) for i in range(n)]

    def pending(self, ctx: Ctx, i: int):
        """A handle op ``i`` must see complete before it is issued, or None."""
        done = ctx.done
        for d in self.waits[i]:
            x = done.get(d)
            if x is not None and not _complete(x):
                return x
        for o in self.owners[i]:
            f = ctx.update_futures.get(o)
            if f is not None and not f.done():
                return f
        return None


def _with_hazards(ops: Sequence[Op], sizes: Sizes, owners: list[list[int]]) -> list[tuple[int, ...]]:
    """The plan's deps plus, per value, read-after-write and write/drop-after-read/write/drop on
    another resource (same resource: FIFO already orders them).  The host parameter buffer a block's
    ``update`` writes and ``load`` copies is a value too (``("load buffer", owner)``)."""
    writer: dict = {}                   # value -> last op that wrote or dropped it
    readers: dict = {}                  # value -> {resource: last op that read it since}
    out = []
    for op in ops:
        eff = effects(op, sizes)
        reads, writes = list(eff.reads), [*eff.writes, *eff.drops]
        if op.kind is OpKind.LOAD:
            reads += [("load buffer", o) for o in owners[op.block]]
        elif op.kind is OpKind.UPDATE:
            writes.append(("load buffer", op.block))
        need = set(op.deps)
        for key in reads:
            if key in writer:
                need.add(writer[key])
        for key in writes:
            if key in writer:
                need.add(writer[key])
            need.update(readers.get(key, {}).values())
        res = op.resource
        for key in reads:
            readers.setdefault(key, {})[res] = op.id
        for key in writes:
            writer[key] = op.id
            readers[key] = {}
        out.append(tuple(sorted(d for d in need if d != op.id and (
            res is Resource.NONE or ops[d].resource is not res or d in op.deps))))
    return out


def _complete(x) -> bool:
    return x.done() if isinstance(x, Future) else x.query()


def dispatch(ctx: Ctx, ops: Sequence[Op]) -> Iterator[Op]:
    """Yield the ops in an issue order that honours the rules above; the caller issues each one
    before asking for the next.  Blocks only when no head can be issued."""
    sched = ctx.schedule
    if sched is None or sched.ops is not ops:
        sched = ctx.schedule = Schedule(ctx, ops)
    ctx.deps = sched.deps
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
