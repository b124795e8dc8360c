"""Gradients on their way to the update: the ``grad_offload`` handler (device norm, then to the host
buffer) and ``TiedGrads``, the assembly of a tied parameter's gradient from its readers' shares."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..ir import Op, Resource, TensorKind
from ..ir.ops import tensor_id
from .context import G, H, Step
from .optim import ckernel
from .optim.clipping import squared_norm
from .store import HostStore


def grad_offload(ctx: Step, op: Op) -> None:
    """The block's accumulated gradient: squared norm on the device (tied parameters excepted: their
    norm needs every reader's share, taken on the host at the end of backward), then to the host
    buffer in the host gradient dtype.  With several ranks: this rank's shard of the summed gradient
    (``reduce_scatter``), whose squared norm the ``all_reduce`` adds to the other ranks'."""
    j = op.block
    run = ctx.run
    lay = run.store.layouts[j]
    ctx.begin(op, Resource.D2H)
    acc = ctx.take(tensor_id(TensorKind.GRAD_SHARD if run.world else TensorKind.GRADS, j), G)
    host = run.store.grad[j]
    if run.nvme_state is not None and run.nvme_state.has(TensorKind.GRADS, j):    # a host copy, for its state_write
        payload = run.nvme_state.empty_copy(TensorKind.GRADS, j)
        ctx.put(tensor_id(TensorKind.GRADS, j), H, payload)
        host = payload["buf"].tensor
    with run.streams.on(Resource.D2H):
        run.streams.keep_alive(acc, Resource.D2H)
        plain = acc[:lay.plain_numel]
        ctx.grad_sq[j] = squared_norm(plain) if lay.plain_numel else None
        host.copy_(acc if host.dtype == acc.dtype else acc.to(host.dtype), non_blocking=True)
    ctx.end(op, Resource.D2H)


class TiedGrads:
    """The gradient of an owner's tied parameters, summed from its readers' host shares into one fp32
    buffer per owner, allocated once and kept for the run.

    A fresh buffer per step costs its page faults every step (0.3 s for Qwen2.5-3B's tied 151,936 x
    2,048 embedding, 1.2 GB), twice a step (norm and update), with the GPU waiting on both.  The
    buffer is rewritten only after the update that reads it: the next step's gradient offload of the
    owner waits for that update, and the norm waits for every gradient offload.  A segment with one
    reader (the tied embedding) is summed and squared in one multi-threaded pass of the C kernel
    (``sum2_sq``): the torch path's copy, add and norm are three passes over the buffer at the end of
    the step, while the GPU waits for the clip coefficient."""

    def __init__(self, store: HostStore):
        self.store = store
        self.buffers: dict[int, torch.Tensor] = {}    # owner -> fp32 buffer of its assembled gradient
        #: owners whose buffer holds the gradient their next update needs (summed for the norm already)
        self.ready: set[int] = set()
        self.pool: ThreadPoolExecutor | None = None   # threads of the fused sum (made on first use)

    def grad(self, o: int) -> torch.Tensor:
        """Owner ``o``'s flat gradient over its owned trainable parameters, tied readers' shares added (fp32)."""
        lay = self.store.layouts[o]
        if not lay.shared:
            return self.store.grad[o][:lay.trainable_numel]
        if o in self.ready:                  # the norm assembled this step's already
            self.ready.discard(o)
            return self.buffers[o]
        return self.sum(o)[0]

    def sum(self, o: int, reuse: bool = True) -> tuple[torch.Tensor, list[float]]:
        """Sum a tied owner's gradient and its readers' into its fp32 buffer (``reuse`` False: a new
        one, when the kept one may be read by an update running now); also the squared norm of each
        shared segment (what the global norm adds to the device norms)."""
        store = self.store
        lay = store.layouts[o]
        n = lay.trainable_numel
        g = self.buffers.get(o) if reuse else torch.empty(n, dtype=torch.float32)
        if g is None:
            g = self.buffers[o] = torch.empty(n, dtype=torch.float32)
        own = store.grad[o]
        lib = _kernels()
        fused = [lib is not None and len(readers) == 1 and _fusable(own, store.grad[readers[0][0]])
                 for _seg, readers in lay.shared]
        covered = sum(seg.numel for (seg, _), f in zip(lay.shared, fused) if f)
        if covered < n:            # what the fused segments do not overwrite
            g.copy_(own[:n])
        sq = []
        for (seg, readers), f in zip(lay.shared, fused):
            lo, hi = seg.offset, seg.offset + seg.numel
            if f:
                r, off = readers[0]
                sq.append(self._sum2_sq(lib, own[lo:hi], store.grad[r][off:off + seg.numel], g[lo:hi]))
                continue
            for r, off in readers:
                g[lo:hi] += store.grad[r][off:off + seg.numel]
            sq.append(float(squared_norm(g[lo:hi])))
        return g, sq

    def _sum2_sq(self, lib, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
        """``out = a + b`` and ``sum(out**2)``, in slices on the pool (ctypes drops the GIL)."""
        n = out.numel()
        threads = max(1, min(torch.get_num_threads(), n // (1 << 20)))
        bounds = [n * k // threads for k in range(threads + 1)]

        def part(k: int) -> float:
            lo, hi = bounds[k], bounds[k + 1]
            return lib.sum2_sq(hi - lo, a[lo:].data_ptr(), int(a.dtype == torch.bfloat16), b[lo:].data_ptr(),
                               int(b.dtype == torch.bfloat16), out[lo:].data_ptr())
        if threads == 1:
            return part(0)
        if self.pool is None:                # one pool for the trainer's life (close() shuts it down)
            self.pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="lazytrain-tied")
        return sum(self.pool.map(part, range(threads)))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def _kernels():
    return ckernel.load()


def _fusable(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.float32, torch.bfloat16) for t in ts)
