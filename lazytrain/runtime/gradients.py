"""The gradient handlers: ``grad_offload`` (device norm, then to the host buffer) and ``update`` (on the
host optimizer's worker), with the step's global norm (``finish_norm``, the clip coefficient) and the
assembly of tied parameters' gradients from their readers' shares."""

from __future__ import annotations

import torch

from ..ir import Op, OpKind, Resource, TensorKind
from .handlers import Ctx, G, _tid
from .streams import Streams


def grad_offload(ctx: Ctx, op: Op) -> None:
    """The block's accumulated gradient: squared norm on the device (tied parameters excepted: their
    norm needs every reader's share, taken on the host at the end of backward), then to the host
    buffer in the host gradient dtype."""
    j = op.block
    lay = ctx.store.layouts[j]
    ctx.begin(op, Resource.D2H)
    acc = ctx.take(_tid(TensorKind.GRADS, j), G)
    host = ctx.store.grad[j]
    with ctx.streams.on(Resource.D2H):
        ctx.streams.keep_alive(acc, Resource.D2H)
        plain = acc[:lay.plain_numel]
        ctx.grad_sq[j] = torch.linalg.vector_norm(plain).square() if lay.plain_numel else None
        host.copy_(acc if host.dtype == acc.dtype else acc.to(host.dtype), non_blocking=True)
    ctx.end(op, Resource.D2H)


def assemble_grad(ctx: Ctx, o: int) -> torch.Tensor:
    """Owner ``o``'s flat gradient over its owned parameters, tied readers' shares added (fp32)."""
    lay = ctx.store.layouts[o]
    if not lay.shared:
        return ctx.store.grad[o][:lay.owned_numel]
    if o in ctx.tied_ready:                  # finish_norm assembled this step's already
        ctx.tied_ready.discard(o)
        return ctx.tied_grad[o]
    return _assemble_tied(ctx, o)[0]


def _assemble_tied(ctx: Ctx, o: int, reuse: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Sum a tied owner's gradient and its readers' into one fp32 buffer, allocated once; also the
    squared norm of each shared segment (what ``finish_norm`` adds to the device norms).

    A fresh 1.2 GB buffer per step (Qwen2.5-3B's tied 151,936 x 2,048 embedding) cost ~0.3 s of page
    faults, twice a step (norm and update), with the GPU waiting on both.  The buffer is rewritten
    only after the update that reads it: the next step's gradient offload of ``o`` waits for that
    update, and ``finish_norm`` waits for every gradient offload.  A segment with one reader (the
    tied embedding) is summed and squared in one multi-threaded pass of the C kernel (``sum2_sq``):
    the torch path's copy, add and norm are three passes over 1.2 GB at the end of the step, while
    the GPU waits for the clip coefficient."""
    lay = ctx.store.layouts[o]
    g = ctx.tied_grad.get(o) if reuse else torch.empty(lay.owned_numel, dtype=torch.float32)
    if g is None:
        g = ctx.tied_grad[o] = torch.empty(lay.owned_numel, dtype=torch.float32)
    own = ctx.store.grad[o]
    lib = _kernels()
    fused = [lib is not None and len(readers) == 1 and _fusable(own, ctx.store.grad[readers[0][0]])
             for _seg, readers in lay.shared]
    covered = sum(seg.numel for (seg, _), f in zip(lay.shared, fused) if f)
    if covered < lay.owned_numel:            # what the fused segments do not overwrite
        g.copy_(own[:lay.owned_numel])
    sq = []
    for (seg, readers), f in zip(lay.shared, fused):
        lo, hi = seg.offset, seg.offset + seg.numel
        if f:
            r, off = readers[0]
            sq.append(_sum2_sq(ctx, lib, own[lo:hi], ctx.store.grad[r][off:off + seg.numel], g[lo:hi]))
            continue
        for r, off in readers:
            g[lo:hi] += ctx.store.grad[r][off:off + seg.numel]
        sq.append(float(torch.linalg.vector_norm(g[lo:hi]).square()))
    return g, sq


def _kernels():
    from .optim import ckernel
    return ckernel.load()


def _fusable(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16) for t in ts)


def _sum2_sq(ctx: Ctx, lib, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    """``out = a + b`` and ``sum(out**2)``, in slices on ``ctx``'s host pool (ctypes drops the GIL)."""
    n = out.numel()
    threads = max(1, min(torch.get_num_threads(), n // (1 << 20)))
    bounds = [n * k // threads for k in range(threads + 1)]

    def part(k: int) -> float:
        lo, hi = bounds[k], bounds[k + 1]
        return lib.sum2_sq(hi - lo, a[lo:].data_ptr(), int(a.dtype == torch.bfloat16), b[lo:].data_ptr(),
                           int(b.dtype == torch.bfloat16), out[lo:].data_ptr())
    if threads == 1:
        return part(0)
    if ctx.host_pool is None:                # one pool for the trainer's life (close() shuts it down)
        from concurrent.futures import ThreadPoolExecutor
        ctx.host_pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="lazytrain-tied")
    return sum(ctx.host_pool.map(part, range(threads)))


def update(ctx: Ctx, op: Op) -> None:
    o = op.block
    if o in ctx.resident_grad:
        apply = o in ctx.pending
        ctx.pending.discard(o)
        ctx.begin(op, Resource.GPU)
        resident_update(ctx, o, ctx.pending_coef if apply else None, ctx.pending_lr)
        ctx.end(op, Resource.GPU)
        return
    if ctx.lagged[o]:
        if o not in ctx.pending:          # first step, a skipped step, or after flush(): nothing to apply
            ctx.done[op.id] = None
            return
        ctx.pending.discard(o)
        coef, lr = ctx.pending_coef, ctx.pending_lr
    else:
        coef, lr = (finish_norm(ctx) if ctx.norm_first else 1.0), ctx.step_lr
    if coef is None:                      # non-finite gradient norm: the step is skipped
        ctx.done[op.id] = None
        return
    run_update(ctx, op, o, coef, lr)


def resident_update(ctx: Ctx, o: int, coef: float | None, lr: float | None) -> None:
    """A resident block's update on the GPU stream, from its GPU accumulator, which is then zeroed
    for this step's backward.  ``coef`` None (first step, skipped step): nothing to apply, but the
    accumulator is cleared all the same (it may hold a skipped step's non-finite gradients)."""
    acc = ctx.resident_grad[o]
    with ctx.streams.on(Resource.GPU):
        if coef is not None:
            ctx.optimizer.step(o, acc, coef, lr)
        acc.zero_()


def run_update(ctx: Ctx, op: Op, o: int, coef: float, lr: float | None) -> None:
    def work():
        ctx.optimizer.step(o, assemble_grad(ctx, o), coef, lr)
    ctx.submit(ctx.streams.cpu, op, work)
    ctx.update_futures[o] = ctx.done[op.id]


def finish_norm(ctx: Ctx) -> float | None:
    """Global gradient norm of this step (once): device norms plus tied parameters' on the host.
    Returns the clip coefficient, or None when the step must be skipped (non-finite norm)."""
    if ctx.norm_done:
        return ctx.coef
    Streams.wait_on_host([ctx.done.get(op.id) for op in ctx.plan.ops if op.kind is OpKind.GRAD_OFFLOAD])
    ctx.tracker.begin_step()
    with ctx.streams.on(Resource.GPU):   # resident accumulators hold whole gradients, tied shares included
        for o, acc in ctx.resident_grad.items():
            ctx.grad_sq[o] = torch.linalg.vector_norm(acc).square()
    on_device = [j for j in range(len(ctx.store.layouts)) if ctx.grad_sq.get(j) is not None]
    sqs = dict(zip(on_device, torch.stack([ctx.grad_sq[j] for j in on_device]).tolist())) if on_device else {}
    for j, lay in enumerate(ctx.store.layouts):      # one device->host read for every block's norm
        sq = sqs.get(j)
        total = 0.0 if sq is None else sq
        if lay.shared and j not in ctx.resident_grad:
            # with a global norm the owner's update comes after this and reuses the sum; without
            # one it may be running now on the update worker, reading the buffer: use a temporary
            reuse = ctx.norm_first
            _, seg_sq = _assemble_tied(ctx, j, reuse=reuse)
            if reuse:
                ctx.tied_ready.add(j)
            total += sum(seg_sq)
        if sq is not None or (lay.shared and j not in ctx.resident_grad):
            ctx.tracker.add(j, total)
    ctx.coef = ctx.tracker.finish_step()
    ctx.norm_done = True
    return ctx.coef
