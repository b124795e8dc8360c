"""Lowering: decisions -> op list.  One lowering for every policy.

Program order is the issue order: the runtime issues ops in this order onto their resources
(each resource runs its ops FIFO) and allocates GPU memory in this order, so ``verify``'s
program-order walk is the memory the runtime sees.  Dependencies are derived, not guessed: every
op depends on the producer of each value it reads when that producer runs on another resource,
and a ``free`` depends on the last reader of the copy on each resource.  The schedule itself:

- forward, window F_j: lagged updates placed here; prefetch (load) of block j+1's parameters;
  then block j for every micro-batch (layer-major), each followed by the offloads of what it
  produced; then ``free params[j]`` (the head block keeps its parameters into its backward);
- backward, per segment [s, e) (decisions.segments()) from the last: prefetch of the next
  segment's parameters and reloads; for every micro-batch, recompute the segment from its kept
  boundary (if it is recomputed) and run backward through it; then ``grad_offload`` and
  ``free params`` per block; same-step updates after their gradients;
- window X: updates placed there.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir import Decisions, Op, OpKind, Place, Resource, Saved, TensorId, TensorKind, Tier, effects
from ..ir.semantics import Sizes
from .cost import CostModel

_T = {Place.GPU: Tier.GPU, Place.HOST: Tier.HOST, Place.NVME: Tier.NVME}


class _Emitter:
    def __init__(self, sizes: Sizes):
        self.sizes = sizes
        self.ops: list[Op] = []
        self.producer: dict[tuple[TensorId, Tier], int] = {}
        self.readers: dict[tuple[TensorId, Tier], dict[Resource, int]] = defaultdict(dict)
        self.window = 0

    def emit(self, kind: OpKind, block: int, *, mb: int | None = None, tensor: TensorId | None = None,
             src: Tier | None = None, dst: Tier | None = None, nbytes: int = 0, save: bool = False,
             resource: Resource = Resource.NONE, seconds: float = 0.0, deps: tuple[int, ...] = ()) -> int:
        i = len(self.ops)
        op = Op(id=i, kind=kind, block=block, mb=mb, tensor=tensor, src=src, dst=dst, nbytes=nbytes, save=save,
                resource=resource, seconds=seconds, window=self.window, deps=())
        eff = effects(op, self.sizes)
        need = set(deps)
        for key in eff.reads:
            p = self.producer.get(key)
            if p is not None and p >= 0 and self.ops[p].resource is not resource:
                need.add(p)
            self.readers[key][resource] = i
        for key in eff.drops:
            if kind is OpKind.FREE:
                p = self.producer.get(key)
                if p is not None and p >= 0:
                    need.add(p)
                need.update(r for res, r in self.readers[key].items() if res is not resource)
        for key in eff.drops:
            self.producer.pop(key, None)
            self.readers.pop(key, None)
        for key in eff.writes:          # the latest writer is the producer (accumulation too)
            if key not in self.producer:
                self.readers[key] = {}
            self.producer[key] = i
        self.ops.append(Op(id=i, kind=kind, block=block, mb=mb, tensor=tensor, src=src, dst=dst, nbytes=nbytes,
                           save=save, resource=resource, seconds=seconds, window=self.window,
                           deps=tuple(sorted(need))))
        return i


def _tid(kind: TensorKind, index: int, mb: int | None = None) -> TensorId:
    return TensorId(kind=kind, index=index, mb=mb)


def default_update_windows(dec: Decisions, graph, clip: bool) -> tuple[int, ...]:
    """Earliest legal windows: with exact clipping every update waits for the end of backward,
    so updates are lagged into the next step's start (window 0) in block order; without clipping
    each update follows its gradients in the backward window of its last contributor."""
    L = dec.n_blocks
    if clip:
        return tuple(0 for _ in range(L))
    out = []
    for j in range(L):
        readers = [b.index for b in graph.blocks if any(p.owner == j for p in b.params)] or [j]
        out.append(2 * L - 1 - min(readers))
    return tuple(out)


def lower(dec: Decisions, cost: CostModel, *, clip: bool = True) -> list[Op]:
    dec.check()
    g = cost.graph
    L, M = g.n_blocks, dec.n_micro
    sizes = cost.sizes
    E = _Emitter(sizes)
    em = E.emit
    G, H, N = Tier.GPU, Tier.HOST, Tier.NVME
    upd = list(dec.update_window) if dec.update_window else list(default_update_windows(dec, g, clip))
    upd = [w if w is not None else d for w, d in zip(upd, default_update_windows(dec, g, clip))]
    owners_loaded_by = {j: sorted({p.owner for p in g.blocks[j].params}) for j in range(L)}
    # a lagged update must be issued no later than the window that loads its parameters again
    for j in range(L):
        if upd[j] < L:
            readers = [b.index for b in g.blocks if any(p.owner == j for p in b.params)] or [j]
            upd[j] = min(upd[j], max(0, min(readers) - 1))
    update_op: dict[int, int] = {}
    grad_off: dict[int, int] = {}
    owns = [g.blocks[j].owned_numel > 0 for j in range(L)]
    contributors = defaultdict(set)
    for b in g.blocks:
        for p in b.params:
            contributors[p.owner].add(b.index)

    resident = cost.resident

    def emit_update(j: int) -> None:
        if not owns[j] or j in update_op:
            return
        deps = tuple(grad_off[c] for c in contributors[j] if c in grad_off)
        update_op[j] = em(OpKind.UPDATE, j, resource=Resource.GPU if j in resident else Resource.CPU,
                          seconds=cost.update_s(j), deps=deps)

    def emit_updates_in(window: int) -> None:
        for j in range(L):
            if upd[j] == window and owns[j]:
                if window < L or all(c in grad_off for c in contributors[j]):
                    emit_update(j)

    param_frees: list[int] = []

    def load(j: int) -> int | None:
        """Parameter load; it waits for the latest parameter free issued before it, so parameter
        slots are bounded in time as they are in program order (prefetch distance 1).  A resident
        block's parameters never move."""
        if j in resident:
            return None
        deps = tuple(update_op[o] for o in owners_loaded_by[j] if o in update_op and E.window < L)
        deps += tuple(param_frees[-1:])
        return em(OpKind.LOAD, j, tensor=_tid(TensorKind.PARAMS, j), src=H, dst=G, nbytes=cost.param_bytes(j),
                  resource=Resource.H2D, seconds=cost.load_s(j), deps=deps)

    saved_offloads: dict[int, list[int]] = defaultdict(list)   # block -> d2h offload op per micro-batch

    def offload_chain(t: TensorId, nbytes: int, to: Tier, block: int, mb: int) -> None:
        """gpu -> host (-> nvme), dropping the copies left behind."""
        i = em(OpKind.OFFLOAD, block, mb=mb, tensor=t, src=G, dst=H, nbytes=nbytes, resource=Resource.D2H,
               seconds=cost.d2h_s(nbytes))
        if t.kind is TensorKind.SAVED:
            saved_offloads[block].append(i)
        em(OpKind.FREE, block, mb=mb, tensor=t, src=G)
        if to is N:
            em(OpKind.OFFLOAD, block, mb=mb, tensor=t, src=H, dst=N, nbytes=nbytes, resource=Resource.NVME,
               seconds=cost.nvme_s(nbytes, True))
            em(OpKind.FREE, block, mb=mb, tensor=t, src=H)

    def reload_chain(t: TensorId, nbytes: int, frm: Tier, block: int, mb: int, keep_host: bool = False) -> None:
        if frm is N:
            em(OpKind.RELOAD, block, mb=mb, tensor=t, src=N, dst=H, nbytes=nbytes, resource=Resource.NVME,
               seconds=cost.nvme_s(nbytes, False))
            em(OpKind.FREE, block, mb=mb, tensor=t, src=N)
        em(OpKind.RELOAD, block, mb=mb, tensor=t, src=H, dst=G, nbytes=nbytes, resource=Resource.H2D,
           seconds=cost.h2d_s(nbytes))
        if not keep_host:
            em(OpKind.FREE, block, mb=mb, tensor=t, src=H)

    # --------------------------------------------------------------------------- forward
    segs = dec.segments()
    needed_in_bwd = {s for s, e in segs if dec.saved[s] is Saved.RECOMPUTE}   # kept boundaries
    bplace = [dec.boundary[i] if i in needed_in_bwd else Place.NONE for i in range(L)]
    if 0 in needed_in_bwd:
        bplace[0] = Place.HOST          # the batch stays on the host; reload it
    pending_off: dict[int, list] = defaultdict(list)  # window -> offloads deferred there

    E.window = 0
    for j in sorted(resident):   # on the GPU stream, ahead of the forward that reads them
        emit_update(j)
    emit_updates_in(0)
    load(0)
    for mb in range(M):
        t = _tid(TensorKind.ACT, 0, mb)
        em(OpKind.RELOAD, 0, mb=mb, tensor=t, src=H, dst=G, nbytes=cost.act_bytes(0), resource=Resource.H2D,
           seconds=cost.h2d_s(cost.act_bytes(0)))
    for j in range(L):
        E.window = j
        if j > 0:
            emit_updates_in(j)
        for fn in pending_off.pop(j, []):
            fn()
        if j + 1 < L:
            load(j + 1)
        save = dec.saved[j] is not Saved.RECOMPUTE
        spread = dec.offload_window[j] if dec.offload_window and dec.offload_window[j] else None
        mb_window = []
        if spread:
            for w, n in spread:
                mb_window += [w] * n
        mb_window = (mb_window + [j] * M)[:M]
        for mb in range(M):
            # throttle: at most two micro-batches of saved activations wait for the D2H stream,
            # so GPU memory stays bounded in time even when the copies are slower than compute
            throttle = tuple(saved_offloads[j][mb - 2: mb - 1]) if mb >= 2 else ()
            em(OpKind.COMPUTE, j, mb=mb, tensor=_tid(TensorKind.ACT, j + 1, mb) if j + 1 < L else None, save=save,
               resource=Resource.GPU, seconds=cost.fwd_s(j), deps=throttle)
            a_in = _tid(TensorKind.ACT, j, mb)
            if bplace[j] is Place.GPU:
                pass                                  # stays until its segment's backward
            elif bplace[j] in (Place.HOST, Place.NVME) and j > 0:
                offload_chain(a_in, cost.act_bytes(j), _T[bplace[j]], j, mb)
            else:                                     # not kept (boundary 0: the host still holds the batch)
                em(OpKind.FREE, j, mb=mb, tensor=a_in, src=G)
            if dec.saved[j] in (Saved.HOST, Saved.NVME):
                st = _tid(TensorKind.SAVED, j, mb)
                to = _T[Place(dec.saved[j].value)]
                w = mb_window[mb]
                if w <= j:
                    offload_chain(st, cost.saved_bytes(j), to, j, mb)
                else:
                    pending_off[w].append(lambda st=st, to=to, j=j, mb=mb:
                                          offload_chain(st, cost.saved_bytes(j), to, j, mb))
        if j < L - 1 and j not in resident:
            param_frees.append(em(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G))
    # offloads deferred past the forward run at the start of the backward
    late = [fn for w in sorted(pending_off) for fn in pending_off[w]]

    # --------------------------------------------------------------------------- backward
    def prefetch(seg: tuple[int, int]) -> None:
        s, e = seg
        for j in range(s, e):
            if j != L - 1:
                load(j)
        recomputed = dec.saved[s] is Saved.RECOMPUTE
        for mb in range(M):
            if recomputed and bplace[s] in (Place.HOST, Place.NVME):
                reload_chain(_tid(TensorKind.ACT, s, mb), cost.act_bytes(s), _T[bplace[s]], s, mb,
                             keep_host=(s == 0))
            for j in range(s, e):
                if dec.saved[j] in (Saved.HOST, Saved.NVME):
                    reload_chain(_tid(TensorKind.SAVED, j, mb), cost.saved_bytes(j), _T[Place(dec.saved[j].value)],
                                 j, mb)

    order = list(reversed(segs))
    E.window = L
    for fn in late:
        fn()
    prefetch(order[0])
    for k, (s, e) in enumerate(order):
        E.window = 2 * L - 1 - (e - 1)
        if k + 1 < len(order):
            prefetch(order[k + 1])
        recomputed = dec.saved[s] is Saved.RECOMPUTE
        for mb in range(M):
            if recomputed:
                for j in range(s, e):
                    em(OpKind.RECOMPUTE, j, mb=mb,
                       tensor=_tid(TensorKind.ACT, j + 1, mb) if j + 1 < e else _tid(TensorKind.SAVED, j, mb),
                       save=True, resource=Resource.GPU, seconds=cost.recompute_s(j))
                    em(OpKind.FREE, j, mb=mb, tensor=_tid(TensorKind.ACT, j, mb), src=G)
            for j in range(e - 1, s - 1, -1):
                em(OpKind.BACKWARD, j, mb=mb, tensor=_tid(TensorKind.GRAD_ACT, j, mb) if j > 0 else None,
                   resource=Resource.GPU, seconds=cost.bwd_s(j))
        for j in range(e - 1, s - 1, -1):
            E.window = 2 * L - 1 - j
            if j in resident:
                continue
            grad_off[j] = em(OpKind.GRAD_OFFLOAD, j, tensor=_tid(TensorKind.GRADS, j), src=G, dst=H,
                             nbytes=cost.grad_bytes(j), resource=Resource.D2H, seconds=cost.grad_offload_s(j))
            param_frees.append(em(OpKind.FREE, j, tensor=_tid(TensorKind.PARAMS, j), src=G))
            for o in range(L):
                if L <= upd[o] < 2 * L and upd[o] <= E.window and o not in update_op \
                        and all(c in grad_off for c in contributors[o]):
                    emit_update(o)
    E.window = 2 * L
    emit_updates_in(2 * L)
    for j in range(L):      # anything whose window could not be honoured runs in X
        emit_update(j)
    return E.ops
