"""The ordering a plan states: what each op waits for, derived once from ``effects``.

Within one period (the op list, one training step) two ops that touch the same copy of a value are a
*hazard* when one of them writes it: read after write, write (or drop, or in-place write) after read,
write after write or drop.  Each resource runs its ops in list order, so a hazard between two ops of
one resource is ordered already; every other hazard must be a dependency in ``op.deps``.  The
lowering writes them there (``HazardWalk.deps``), ``verify`` refuses a plan that lacks one, and the
interpreter and the simulator read nothing but ``op.deps``: the plan file is the whole contract.

Updates add two rules of their own (``UpdateOrder``): an ``update`` placed before its gradients'
``grad_offload`` is *lagged* (it applies the previous step's gradients), and a same-step host update
takes the step's gradient norm, which is complete once the last ``grad_offload`` before it is done
(the clip coefficient's wait; with several ranks, once the ``all_reduce`` of the ranks' norms that
follows it is).  Across the period boundary (``cross_period``) a lagged update waits
for the previous step's gradients, and a block's first load waits for the previous step's same-step
update of each block whose parameters it reads.  ``docs/architecture.md`` ("The plan contract")
describes the whole of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from .kinds import STEP_END_KINDS
from .ops import Op, OpKind, Resource
from .semantics import Effects, Sizes, Value


class Hazard(NamedTuple):
    """Op ``before`` (earlier in the list) must finish before the op this hazard belongs to starts.

    ``kind``: ``"read"`` (the op reads ``value``, which ``before`` wrote), ``"write"`` (it writes, drops
    or overwrites ``value``, which ``before`` read), ``"overwrite"`` (``before`` wrote or dropped it
    too), ``"norm"`` (a same-step update takes the step's gradient norm: ``before`` is the last
    ``grad_offload`` so far; ``value`` is None)."""

    before: int
    value: Value | None
    kind: str


#: ``Hazard((before, value, kind))`` built in C: a NamedTuple's own constructor is a Python call, and a walk
#: makes about three hazards per op (~10^5 for a 72-micro-batch plan of 80 blocks)
_hazard = partial(tuple.__new__, Hazard)
#: the enum members the walk reads once per op, as module constants: in Python 3.11 a member read off its Enum
#: class is ~0.15 us (EnumType's ``__getattr__`` keeps it off the interpreter's attribute cache)
_UPDATE, _GRAD_OFFLOAD, _ALL_REDUCE, _GPU, _NONE = (OpKind.UPDATE, OpKind.GRAD_OFFLOAD, OpKind.ALL_REDUCE,
                                                   Resource.GPU, Resource.NONE)


class HazardWalk:
    """The hazards of ops taken in program order, one op at a time: the lowering asks as it emits
    (``deps``), ``verify`` as it checks a list (``step``)."""

    def __init__(self):
        # keyed by (kind, index, mb, tier): hashed in C, where a TensorId hashes in Python
        self.writer: dict[tuple, int] = {}              # value -> last op that wrote, dropped or overwrote it
        self.readers: dict[tuple, dict[Resource, int]] = {}  # value -> resource -> last op there that read it since
        self.last_grad_offload = -1
        #: the op after which the step's gradient norm is known: the last grad_offload, or with several
        #: ranks the all_reduce of the norms that follows it
        self.last_norm = -1

    def step(self, op: Op, eff: Effects) -> list[Hazard]:
        """The hazards of ``op`` (the next op of the list, with its effects) on the ops before it."""
        return self.hazards(op.id, op.kind, op.resource, eff)

    def hazards(self, me: int, kind: OpKind, res: Resource, eff: Effects) -> list[Hazard]:
        """``step`` of the op with id ``me``, ``kind`` and ``resource`` ``res``: the lowering asks before it
        builds the op, whose deps are what it asks for."""
        writer, readers = self.writer, self.readers
        found: list[Hazard] = []
        same_step = bool(eff.reads)     # every value it reads was written in this list
        for v in eff.reads:
            t, tier = v
            key = (t.kind, t.index, t.mb, tier)
            w = writer.get(key)
            if w is None:
                same_step = False
            else:
                found.append(_hazard((w, v, "read")))
            r = readers.get(key)
            if r is None:
                readers[key] = {res: me}
            else:
                r[res] = me
        for group in (eff.writes, eff.drops, eff.mutates):
            for v in group:
                t, tier = v
                key = (t.kind, t.index, t.mb, tier)
                r = readers.get(key)
                if r:           # then no reader since this write (an empty or absent entry reads the same)
                    for x in r.values():
                        if x != me:
                            found.append(_hazard((x, v, "write")))
                    r.clear()
                w = writer.get(key)
                if w is not None and w != me:
                    found.append(_hazard((w, v, "overwrite")))
                writer[key] = me
        # a host update in the step of its gradients (every gradient it reads was offloaded in this
        # list) may apply the step's clip coefficient: the norm is complete once the D2H stream has
        # run every grad_offload so far, i.e. once the last one is done
        if kind is _UPDATE and same_step and self.last_norm >= 0 and res is not _GPU:
            found.append(Hazard(self.last_norm, None, "norm"))
        elif kind is _GRAD_OFFLOAD:
            self.last_grad_offload = self.last_norm = me
        elif kind is _ALL_REDUCE:     # sums the norms of every grad_offload so far
            if self.last_grad_offload >= 0:
                found.append(Hazard(self.last_grad_offload, None, "norm"))
            self.last_norm = me
        return found

    def deps(self, op: Op, eff: Effects, ops: list[Op]) -> set[int]:
        """``step``, as the dependencies the hazards need (``ops``: the ops before ``op``)."""
        return self.deps_of(op.id, op.kind, op.resource, eff, ops)

    def deps_of(self, me: int, kind: OpKind, res: Resource, eff: Effects, ops: list[Op]) -> set[int]:
        """``hazards``, as the dependencies they need (``needs_dep``): all of them for an op without a
        resource, else those on an op of another resource."""
        found = self.hazards(me, kind, res, eff)
        if res is _NONE:
            return {h.before for h in found}
        return {h.before for h in found if ops[h.before].resource is not res}


def needs_dep(op: Op, before: Op) -> bool:
    """Is a hazard between ``before`` and ``op`` left unordered without a dependency?  Yes unless both
    run on one resource, whose FIFO orders them (a ``free`` has no resource and no FIFO)."""
    return op.resource is Resource.NONE or before.resource is not op.resource


@dataclass(frozen=True)
class UpdateOrder:
    """Where each block's update sits relative to its gradients in one period."""

    updates: dict[int, int]          # owner block -> op id of its update
    grad_offloads: dict[int, int]    # block -> op id of its grad_offload
    #: owners whose update comes before every grad_offload of their readers: it applies the previous
    #: step's gradients (a resident or GPU-updated block's update, on the GPU, always does)
    lagged: frozenset[int]
    #: no same-step host update runs before the step's last grad_offload, so each of them can apply the
    #: step's clip coefficient (the runtime then takes the global norm before the first of them)
    norm_first: bool

    @classmethod
    def of(cls, ops: list[Op], sizes: Sizes) -> UpdateOrder:
        grad_offload, update = OpKind.GRAD_OFFLOAD, OpKind.UPDATE    # locals: a member read off its Enum is slow
        grad_off = {op.block: op.id for op in ops if op.kind is grad_offload}
        updates = {op.block: op.id for op in ops if op.kind is update}
        last = max(grad_off.values(), default=-1)
        lagged, norm_first = set(), True
        for owner, u in updates.items():
            gs = [grad_off[r] for r in sizes.readers(owner) if r in grad_off]
            if owner in sizes.resident or owner in sizes.gpu_updated or (gs and all(g > u for g in gs)):
                lagged.add(owner)
            elif u < last:
                norm_first = False
        return cls(updates=updates, grad_offloads=grad_off, lagged=frozenset(lagged), norm_first=norm_first)

    def takes_norm(self, op: Op) -> bool:
        """A same-step host update of a norm-first plan: it applies this step's clip coefficient."""
        return self.norm_first and op.kind is OpKind.UPDATE and op.block not in self.lagged \
            and op.resource is not Resource.GPU


def cross_period(ops: list[Op], sizes: Sizes, *, clip: bool) -> dict[int, list[int]]:
    """op id -> ids in the *previous* period it must wait for (the list repeats every step).

    A lagged update applies the previous step's gradients: with exact clipping it needs that step's
    global norm, so the whole of its backward and gradient offloads, else its own gradients' offloads
    (a resident block's: every gradient offload).  A same-step update writes the host parameters that
    the next step's first load of a block reading them copies.  A GPU-updated block's update applies the
    accumulator its previous backward left on the GPU (with clipping, after the whole previous backward), and
    its ``state_load`` reads the host state the previous ``state_store`` wrote."""
    order = UpdateOrder.of(ops, sizes)
    ending = STEP_END_KINDS
    load, scatter, state_load = OpKind.LOAD, OpKind.REDUCE_SCATTER, OpKind.STATE_LOAD   # (a member read off its
    step_end = [op.id for op in ops if op.kind in ending]                               # Enum is slow)
    grad_off = order.grad_offloads
    first_load: dict[int, int] = {}             # owner -> the first load of a block reading its parameters
    for op in ops:
        if op.kind is load:
            for o in sizes.owners(op.block):
                first_load.setdefault(o, op.id)
    extra: dict[int, list[int]] = {}
    # with several ranks a resident block's reduce_scatter adds into the accumulators its owners' updates read
    scatters = {op.block: op.id for op in ops if op.kind is scatter and op.block in sizes.resident}
    for op in ops:          # reads what the previous state_store wrote; the runtime starts no step before
        if op.kind is state_load:    # the previous one's device work is done, so neither does this
            extra.setdefault(op.id, []).extend(step_end)
    writes = {op.tensor: op.id for op in ops if op.kind is OpKind.STATE_WRITE}
    for op in ops:          # a file read back after the previous step's last write of it (FIFO on one worker)
        if op.kind is OpKind.STATE_READ and op.tensor in writes:
            extra.setdefault(op.id, []).append(writes[op.tensor])
    for owner, u in order.updates.items():
        if owner in sizes.gpu_updated:
            extra.setdefault(u, []).extend(step_end if clip else [op.id for op in ops if op.kind is OpKind.BACKWARD
                                                                   and op.block in sizes.readers(owner)])
            continue
        if owner in sizes.resident:
            extra[u] = step_end if clip else [*grad_off.values(),
                                              *(scatters[r] for r in sizes.readers(owner) if r in scatters)]
            continue
        gs = [grad_off[r] for r in sizes.readers(owner) if r in grad_off]
        if owner in order.lagged:
            extra.setdefault(u, []).extend(step_end if clip else gs)
        elif gs and owner in first_load:
            extra.setdefault(first_load[owner], []).append(u)
    return extra
