"""Lowering: decisions -> op list.  One lowering for every policy.

Program order is the issue order: the runtime issues ops in this order onto their resources
(each resource runs its ops FIFO) and allocates GPU memory in this order, so ``verify``'s
program-order walk is the memory the runtime sees.  The schedule, in named steps:

- ``start``: the updates that run at the step's start (every update with exact clipping: lagged,
  it needs the previous step's global norm; a resident block's, on the GPU), the first load and
  the batch;
- ``forward``, window F_j: prefetch (load) of block j+1's parameters; then block j for every
  micro-batch (layer-major), each followed by the offloads of what it produced; then
  ``free params[j]`` (the head block keeps its parameters into its backward);
- ``backward``, per segment [s, e) (``Decisions.segments``) from the last: prefetch of the next
  segment's parameters and reloads; for every micro-batch, recompute the segment from its kept
  boundary (if it is recomputed) and run backward through it; then ``grad_offload`` and
  ``free params`` per block; without clipping, each update right after its last gradient.

A block without parameters (an activation or a dropout of an ``nn.Sequential``) keeps its zero-byte ``load``
and ``free`` of its parameter set (the runtime's forward reads one), but its gradient is empty: the accumulator
its backward makes is freed on the GPU, with no ``reduce_scatter``, ``grad_offload`` or ``update`` (no update
would read it); it cannot be GPU-updated.

A GPU-updated block (``Decisions.gpu_update``) has no ``grad_offload`` (its accumulator stays on the GPU
into the next step) and no host update or forward load: its ``state_load`` (H2D) brings its parameters and
optimizer state in, its ``update`` runs on the GPU stream just before its forward, and its ``state_store``
(D2H) writes both back.  The first ``STATE_SLOTS`` state loads are issued at the step's start, each later one
after the store ``STATE_SLOTS`` blocks before it (bounding the states on the GPU).

With several ranks (``CostModel.world_size``, ``ir.sharding``) a ``load`` copies this rank's shard
and an ``all_gather`` on the collective stream assembles the block; a ``reduce_scatter`` precedes
each ``grad_offload``, which then moves this rank's shard of the summed gradient; after the backward
one ``all_reduce`` sums the ranks' squared gradient norms.  A resident block keeps only its shards on the
GPU (``ir.semantics.resident_shards``): it is gathered once a step, before its forward, and after its
backward reduce-scattered into its shard accumulator and freed.  A world of one emits none of them.

State kept on NVMe (``Decisions.nvme_state``): an update of a block with any component there is emitted in the
forward ``STATE_AHEAD`` blocks before the block's load (not at the step's start, where every placed block's state
would be on the host at once): ``state_read`` of its gradient and optimizer state (and parameters) before it,
``state_write`` of what it changed after it, the optimizer state freed at once and the parameters kept for the
load that follows; the reads of the next such block come before this one's update, so the NVMe worker (FIFO)
reads while the host updates, not after the writes that wait for the update.  Every other load of placed
parameters reads them just before it and frees them just after; a placed gradient goes back to its file right
after its ``grad_offload``.  A ``state_read`` of a component waits for the ``free`` of that component
``NVME_STATE_SLOTS`` reads before it, so the host copies stay bounded in time as they are in program order.

Dependencies: the two the schedule chooses for memory (a compute waits for the offload of the
micro-batch two before it; a load waits for the latest parameter free), and every hazard on a value
with an earlier op (``ir.order.HazardWalk``, from ``effects``), found as each op is emitted.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir import Decisions, Op, OpKind, Place, Resource, Saved, TensorId, TensorKind, Tier
from ..ir.kinds import resource as default_resource
from ..ir.ops import tensor_id
from ..ir.order import HazardWalk
from ..ir.semantics import Effects, effects_of
from ..ir.tiers import TIERS, Copy, copy, path
from .cost import CostModel

#: where a decision keeps a value off the GPU, as the tier it is offloaded to and reloaded from (``Place`` and
#: ``Saved`` name the tiers by their values)
_OFF_GPU = {p: Tier(p.value) for p in Place if p.value in TIERS and p is not Place.GPU}
_SAVED_OFF = {s: Tier(s.value) for s in Saved if s.value in TIERS}
G, H = Tier.GPU, Tier.HOST


#: GPU-updated blocks whose state may be on the GPU at once: 3, so a state load spans the forwards before it
#: [ledger: gpu-update-state-slots]
STATE_SLOTS = 3


#: how many blocks ahead of its load a placed block's update runs, and the host copies of one component of NVMe
#: state that may be in flight at once (the update's read-ahead and the load's) [ledger: nvme-state-slots]
STATE_AHEAD = 1
NVME_STATE_SLOTS = 3

_tid = tensor_id
_PARAMS, _GRADS, _OSTATE = TensorKind.PARAMS, TensorKind.GRADS, TensorKind.OPT_STATE


def lower(dec: Decisions, cost: CostModel, *, clip: bool = True) -> list[Op]:
    return lower_with_effects(dec, cost, clip=clip)[0]


def lower_with_effects(dec: Decisions, cost: CostModel, *, clip: bool = True) -> tuple[list[Op], list[Effects]]:
    """The op list and each op's ``effects``, which the lowering computes anyway to find the hazards:
    ``verify`` and ``simulate`` take them rather than computing them twice more."""
    dec.check()
    low = _Lowering(dec, cost, clip)
    low.start()
    low.forward()
    low.backward()
    return low.ops, low.effs


class _Lowering:
    def __init__(self, dec: Decisions, cost: CostModel, clip: bool):
        self.dec, self.cost, self.clip = dec, cost, clip
        g = cost.graph
        self.L, self.M = g.n_blocks, dec.n_micro
        self.sizes = cost.sizes
        self.resident = cost.resident
        self.gpu_updated = cost.gpu_updated
        #: GPU-updated blocks in forward order, and the op id of each one's state_store once emitted
        self.gu_order = sorted(self.gpu_updated)
        self.state_updates: list[int] = []
        self.ops: list[Op] = []
        self.effs: list[Effects] = []
        self.hazards = HazardWalk()
        self.window = 0
        #: blocks with an update: those owning trainable parameters (a frozen base's block has none)
        self.owns = [g.blocks[j].trainable_numel > 0 for j in range(self.L)]
        #: blocks that read trainable parameters (their own or tied ones): a block without any (an activation, a
        #: reshape, a frozen base's block) has an empty gradient, which is dropped on the GPU, never offloaded
        self.has_params = [g.blocks[j].grad_numel > 0 for j in range(self.L)]
        empty = sorted(j for j in self.gpu_updated if not self.owns[j])
        if empty:
            raise ValueError(f"blocks {empty} own no parameters: they cannot be GPU-updated (decisions.gpu_update)")
        self.updated: set[int] = set()
        #: state kept on NVMe, as (tensor kind, block) pairs (``Sizes.nvme``); the placed host copies in program
        #: order now, and each component's frees of them (a read waits for the one ``NVME_STATE_SLOTS`` back)
        self.nvme = self.sizes.nvme
        self.nvme_blocks = frozenset(j for _, j in self.nvme)
        self.staged: set[tuple[TensorKind, int]] = set()
        self.state_frees: dict[TensorKind, list[int]] = defaultdict(list)
        self.gathered: set[int] = set()     # resident blocks gathered this step (several ranks)
        self.param_frees: list[int] = []
        self.saved_offloads: dict[int, list[int]] = defaultdict(list)   # block -> d2h offload per micro-batch
        self.segs = dec.segments()
        needed_in_bwd = {s for s, e in self.segs if dec.saved[s] is Saved.RECOMPUTE}   # kept boundaries
        self.bplace = [dec.boundary[i] if i in needed_in_bwd else Place.NONE for i in range(self.L)]
        if 0 in needed_in_bwd:
            self.bplace[0] = Place.HOST          # the batch stays on the host; reload it
        # without clipping an update follows the gradient offload of the lowest block reading its parameters
        self.updates_after: dict[int, list[int]] = defaultdict(list)
        if not clip:
            for o in range(self.L):
                if o not in self.resident and o not in self.gpu_updated:
                    self.updates_after[min(cost.sizes.readers(o))].append(o)

    def emit(self, kind: OpKind, block: int, *, mb: int | None = None, tensor: TensorId | None = None,
             src: Tier | None = None, dst: Tier | None = None, nbytes: int = 0, save: bool = False,
             resource: Resource | None = None, seconds: float = 0.0, deps: tuple[int, ...] = ()) -> int:
        """Append an op, on ``resource`` or else its kind's (``ir.kinds``); its dependencies are ``deps`` (the
        schedule's own) and every hazard's, found from its fields before it is built (a frozen op is built once)."""
        i = len(self.ops)
        if resource is None:
            resource = default_resource(kind)
        eff = effects_of(kind, block, mb, tensor, src, dst, save, self.sizes)
        self.effs.append(eff)
        need = self.hazards.deps_of(i, kind, resource, eff, self.ops)
        need.update(deps)
        self.ops.append(Op(id=i, kind=kind, block=block, mb=mb, tensor=tensor, src=src, dst=dst, nbytes=nbytes,
                           save=save, resource=resource, seconds=seconds, window=self.window, deps=tuple(sorted(need))))
        return i

    # ---- pieces ------------------------------------------------------------------------------------
    def update(self, j: int) -> None:
        if not self.owns[j] or j in self.updated:
            return
        placed = j in self.nvme_blocks
        if placed:
            self.update_reads(j)
        self.updated.add(j)
        on_gpu = j in self.resident or j in self.gpu_updated
        self.emit(OpKind.UPDATE, j, resource=Resource.GPU if on_gpu else Resource.CPU, seconds=self.cost.update_s(j))
        if placed:
            self.state_write(_OSTATE, j)
            self.state_free(_OSTATE, j)
            self.state_write(_PARAMS, j)
            if not self.clip:    # a same-step update: the next load is the next step's
                self.state_free(_PARAMS, j)

    # ---- state kept on NVMe ------------------------------------------------------------------------
    def update_reads(self, j: int) -> None:
        """What block j's update reads of its state kept on NVMe (with clipping, lagged: last step's gradient is in
        its file; without, on the host, just offloaded), unless read already (the forward reads one block ahead of
        the update, so the NVMe worker reads the next block's state while the host updates this one)."""
        if j not in self.nvme_blocks or not self.owns[j] or j in self.updated:
            return
        if self.clip:
            for r in self.sizes.readers(j):
                self.state_read(_GRADS, r)
        self.state_read(_OSTATE, j)
        self.state_read(_PARAMS, j)

    def state_read(self, kind: TensorKind, j: int) -> None:
        """A host copy of block j's ``kind`` from its file, if it lives there and is not on the host already."""
        if (kind, j) not in self.nvme or (kind, j) in self.staged:
            return
        self.staged.add((kind, j))
        t, c = _tid(kind, j), self.cost
        n = self.sizes.of(t, H)
        frees = self.state_frees[kind]
        self.emit(OpKind.STATE_READ, j, tensor=t, src=Tier.NVME, dst=H, nbytes=n, seconds=c.hw.nvme_seconds(n, False),
                  deps=tuple(frees[-NVME_STATE_SLOTS:-NVME_STATE_SLOTS + 1]) if len(frees) >= NVME_STATE_SLOTS else ())

    def state_write(self, kind: TensorKind, j: int) -> None:
        """Block j's changed host copy of ``kind`` back into its file, if it lives there."""
        if (kind, j) not in self.nvme:
            return
        t, c = _tid(kind, j), self.cost
        n = self.sizes.of(t, H)
        self.emit(OpKind.STATE_WRITE, j, tensor=t, src=H, dst=Tier.NVME, nbytes=n, seconds=c.hw.nvme_seconds(n, True))

    def state_free(self, kind: TensorKind, j: int) -> None:
        """Drop block j's host copy of ``kind`` kept on NVMe (its file holds it)."""
        if (kind, j) not in self.staged:
            return
        self.staged.discard((kind, j))
        self.state_frees[kind].append(self.emit(OpKind.FREE, j, tensor=_tid(kind, j), src=H))

    def state_load(self, k: int) -> None:
        """The k-th GPU-updated block's parameters and state host -> GPU, after the update ``STATE_SLOTS`` before
        (not its store: the D2H stream may still be draining the forward's offloads, and the loads would wait for
        them; the states left waiting for their store are in the simulator's memory curve, which the budget
        checks)."""
        j, c = self.gu_order[k], self.cost
        n = c.state_bytes(j)
        self.emit(OpKind.STATE_LOAD, j, tensor=_tid(TensorKind.OPT_STATE, j), src=H, dst=G, nbytes=n,
                  seconds=c.state_load_s(j),
                  deps=(self.state_updates[k - STATE_SLOTS],) if k >= STATE_SLOTS else ())

    def gpu_update(self, j: int) -> None:
        """A GPU-updated block, just before its forward: its update, its state back to the host, and the
        next state load the freed slot allows."""
        c = self.cost
        self.update(j)
        self.state_updates.append(len(self.ops) - 1)
        n = c.state_bytes(j, load=False)
        self.emit(OpKind.STATE_STORE, j, tensor=_tid(TensorKind.OPT_STATE, j), src=G, dst=H, nbytes=n,
                  seconds=c.state_store_s(j))
        k = len(self.state_updates) - 1 + STATE_SLOTS
        if k < len(self.gu_order):
            self.state_load(k)

    def load(self, j: int) -> None:
        """Parameter load; it waits for the latest parameter free issued before it, so parameter
        slots are bounded in time as they are in program order (prefetch distance 1).  A resident
        block's parameters never move."""
        c = self.cost
        if j in self.resident:      # with several ranks, its shards gathered once a step, kept to its backward
            if c.sharded and j not in self.gathered:
                self.gathered.add(j)
                self.emit(OpKind.ALL_GATHER, j, tensor=_tid(TensorKind.PARAMS, j),
                          nbytes=c.sizes.of(_tid(TensorKind.PARAMS, j)),
                          seconds=c.all_gather_s(j))
            return
        if c.sharded:        # this rank's shard in, then every rank's gathered on the collective stream
            self.emit(OpKind.LOAD, j, tensor=_tid(TensorKind.PARAM_SHARD, j), src=H, dst=G, nbytes=c.load_bytes(j),
                      seconds=c.load_s(j), deps=tuple(self.param_frees[-1:]))
            self.emit(OpKind.ALL_GATHER, j, tensor=_tid(TensorKind.PARAMS, j),
                      nbytes=c.sizes.of(_tid(TensorKind.PARAMS, j)),
                      seconds=c.all_gather_s(j))
            return
        if j in self.nvme_blocks and self.clip:     # a placed block's lagged update comes first (it reads them)
            self.update(j)
        self.state_read(_PARAMS, j)
        self.emit(OpKind.LOAD, j, tensor=_tid(TensorKind.PARAMS, j), src=H, dst=G, nbytes=c.load_bytes(j),
                  seconds=c.load_s(j), deps=tuple(self.param_frees[-1:]))
        self.state_free(_PARAMS, j)

    def copy(self, c: Copy, t: TensorId, nbytes: int, block: int, mb: int) -> int:
        """One hop of a move between tiers, on its resource at its bandwidth (``ir.tiers``)."""
        return self.emit(c.kind, block, mb=mb, tensor=t, src=c.src, dst=c.dst, nbytes=nbytes, resource=c.resource,
                         seconds=self.cost.copy_s(c, nbytes))

    def offload_chain(self, t: TensorId, nbytes: int, to: Tier, block: int, mb: int) -> None:
        """gpu -> host (-> nvme), dropping the copies left behind."""
        for c in path(G, to):
            i = self.copy(c, t, nbytes, block, mb)
            if c.src is G and t.kind is TensorKind.SAVED:
                self.saved_offloads[block].append(i)
            self.emit(OpKind.FREE, block, mb=mb, tensor=t, src=c.src)

    def reload_chain(self, t: TensorId, nbytes: int, frm: Tier, block: int, mb: int, keep_host: bool = False) -> None:
        """(nvme ->) host -> gpu, dropping the copies left behind (the host one unless ``keep_host``)."""
        for c in path(frm, G):
            self.copy(c, t, nbytes, block, mb)
            if not (keep_host and c.src is H):
                self.emit(OpKind.FREE, block, mb=mb, tensor=t, src=c.src)

    # ---- the step ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.window = 0
        for j in sorted(self.resident):   # on the GPU stream, ahead of the forward that reads them
            self.update(j)
        if self.clip:            # (a block with state on NVMe: in the forward, ahead of its load)
            for j in range(self.L):
                if j not in self.gpu_updated and j not in self.nvme_blocks:
                    self.update(j)
            first = min(STATE_AHEAD + 1, self.L)    # the placed blocks the forward's windows come too late for
            for j in range(min(first + 1, self.L)):
                self.update_reads(j)
            for j in range(first):
                if j in self.nvme_blocks:
                    self.update(j)
        if 0 not in self.gpu_updated:
            self.load(0)
        c = self.cost
        for mb in range(self.M):
            self.copy(copy(H, G), _tid(TensorKind.ACT, 0, mb), c.act_bytes(0), 0, mb)
        for k in range(min(STATE_SLOTS, len(self.gu_order))):
            self.state_load(k)

    def forward(self) -> None:
        dec, c, L = self.dec, self.cost, self.L
        for j in range(L):
            self.window = j
            if j in self.gpu_updated:
                self.gpu_update(j)
            ahead = j + 1 + STATE_AHEAD
            if self.clip and ahead + 1 < L:      # the next one's reads first: they run while the host updates
                self.update_reads(ahead + 1)
            if self.clip and ahead < L and ahead in self.nvme_blocks:
                self.update(ahead)
            if j + 1 < L and j + 1 not in self.gpu_updated:
                self.load(j + 1)
            save = dec.saved[j] is not Saved.RECOMPUTE
            for mb in range(self.M):
                # throttle: at most two micro-batches of saved activations wait for the D2H stream,
                # so GPU memory stays bounded in time even when the copies are slower than compute
                throttle = tuple(self.saved_offloads[j][mb - 2: mb - 1]) if mb >= 2 else ()
                self.emit(OpKind.COMPUTE, j, mb=mb, tensor=_tid(TensorKind.ACT, j + 1, mb) if j + 1 < L else None,
                          save=save, seconds=c.saving_fwd_s(j) if save else c.fwd_s(j),
                          deps=throttle)
                a_in = _tid(TensorKind.ACT, j, mb)
                if self.bplace[j] is Place.GPU:
                    pass                                  # stays until its segment's backward
                elif self.bplace[j] in _OFF_GPU and j > 0:
                    self.offload_chain(a_in, c.act_bytes(j), _OFF_GPU[self.bplace[j]], j, mb)
                else:                                     # not kept (boundary 0: the host still holds the batch)
                    self.emit(OpKind.FREE, j, mb=mb, tensor=a_in, src=G)
                if dec.saved[j] in _SAVED_OFF:
                    self.offload_chain(_tid(TensorKind.SAVED, j, mb), c.saved_bytes(j), _SAVED_OFF[dec.saved[j]],
                                       j, mb)
            if j < L - 1 and j not in self.resident:   # a GPU-updated block's (after its store) bounds no load
                free = self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G)
                if j not in self.gpu_updated:
                    self.param_frees.append(free)

    def prefetch(self, seg: tuple[int, int]) -> None:
        dec, c = self.dec, self.cost
        s, e = seg
        for j in range(s, e):
            if j != self.L - 1:
                self.load(j)
        recomputed = dec.saved[s] is Saved.RECOMPUTE
        for mb in range(self.M):
            if recomputed and self.bplace[s] in _OFF_GPU:
                self.reload_chain(_tid(TensorKind.ACT, s, mb), c.act_bytes(s), _OFF_GPU[self.bplace[s]], s, mb,
                                  keep_host=(s == 0))
            for j in range(s, e):
                if dec.saved[j] in _SAVED_OFF:
                    self.reload_chain(_tid(TensorKind.SAVED, j, mb), c.saved_bytes(j), _SAVED_OFF[dec.saved[j]],
                                      j, mb)

    def backward(self) -> None:
        dec, c, L = self.dec, self.cost, self.L
        order = list(reversed(self.segs))
        self.window = L
        self.prefetch(order[0])
        for k, (s, e) in enumerate(order):
            self.window = 2 * L - 1 - (e - 1)
            if k + 1 < len(order):
                self.prefetch(order[k + 1])
            recomputed = dec.saved[s] is Saved.RECOMPUTE
            for mb in range(self.M):
                if recomputed:
                    for j in range(s, e):
                        out = _tid(TensorKind.ACT, j + 1, mb) if j + 1 < e else _tid(TensorKind.SAVED, j, mb)
                        self.emit(OpKind.RECOMPUTE, j, mb=mb, tensor=out, save=True,
                                  seconds=c.recompute_s(j))
                        self.emit(OpKind.FREE, j, mb=mb, tensor=_tid(TensorKind.ACT, j, mb), src=G)
                for j in range(e - 1, s - 1, -1):
                    self.emit(OpKind.BACKWARD, j, mb=mb, tensor=_tid(TensorKind.GRAD_ACT, j, mb) if j > 0 else None,
                              seconds=c.bwd_s(j))
            for j in range(e - 1, s - 1, -1):
                self.window = 2 * L - 1 - j
                if j in self.resident:
                    if c.sharded:    # summed into the resident shard accumulators; the gathered copy dropped
                        self.emit(OpKind.REDUCE_SCATTER, j, tensor=_tid(TensorKind.GRAD_SHARD, j),
                                  nbytes=c.sizes.of(_tid(TensorKind.GRADS, j)),
                                  seconds=c.reduce_scatter_s(j))
                        self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G)
                    continue
                if j in self.gpu_updated:    # the accumulator stays for the next step's update on the GPU
                    self.param_frees.append(self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G))
                    continue
                if not self.has_params[j]:   # an empty gradient: no update reads it, nothing to reduce or offload
                    self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.GRADS, j), src=G)
                    self.param_frees.append(self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G))
                    continue
                if c.sharded:    # the ranks' gradients summed, this rank's shard kept
                    self.emit(OpKind.REDUCE_SCATTER, j, tensor=_tid(TensorKind.GRAD_SHARD, j),
                              nbytes=c.sizes.of(_tid(TensorKind.GRADS, j)),
                              seconds=c.reduce_scatter_s(j))
                self.emit(OpKind.GRAD_OFFLOAD, j, tensor=_tid(TensorKind.GRADS, j), src=G, dst=H,
                          nbytes=c.grad_bytes(j), seconds=c.grad_offload_s(j))
                if (_GRADS, j) in self.nvme and self.clip:      # back to its file for the next step's update
                    self.staged.add((_GRADS, j))
                    self.state_write(_GRADS, j)
                    self.state_free(_GRADS, j)
                self.param_frees.append(self.emit(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G))
                for o in self.updates_after[j]:
                    self.update(o)
        if c.sharded:            # the ranks' squared norms summed: the global norm the clip needs
            self.window = 2 * L - 1
            self.emit(OpKind.ALL_REDUCE, 0, nbytes=4 * L, seconds=c.all_reduce_s())
