"""The update path, in one place: which updates are lagged, the gradients they still have to apply,
the clip coefficient and its wait, and ``flush``.

The op list is one period of the steady state (``ir.order.UpdateOrder``):

- a *lagged* update (placed before its gradients' ``grad_offload``; every update with exact
  clipping, and a resident block's always) applies the *previous* step's gradients with that step's
  clip coefficient and learning rate: ``end_step`` records them as *pending*, the next step's
  update applies them, ``flush`` applies them between steps.  The first step, a skipped step
  (non-finite norm) and a flush leave nothing pending: the update then does nothing;
- a *same-step* update applies this step's gradients: with the step's clip coefficient when the
  plan is *norm-first* (every same-step update follows the last ``grad_offload``; the global norm is
  then taken before the first of them, and ``Trainer`` refuses a clipping optimizer otherwise),
  else with none.  Its host work runs on the CPU worker; the next step's first load of a block
  reading its parameters waits for it (``future``).

A GPU-updated streamed block (``Decisions.gpu_update``) is lagged too: its accumulator stays on the GPU from
its backward into the next step (``kept``: taken from the step's copies at its end, put back at the next
one's start), where its update applies it on the GPU to the state ``state_load`` brought (``gpu_update.py``);
``flush`` applies a pending one on the host, from the accumulator.

The global norm (``coefficient``): the device norms ``grad_offload`` took, the resident and GPU-updated
blocks' accumulators, and the tied parameters' shares summed on the host (``gradients.TiedGrads``), once
per step, after every gradient offload; ``GradNormTracker`` turns it into the coefficient (None:
skip the step).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ..ir import Op, PlanError, Resource, TensorKind
from ..ir.ops import tensor_id
from ..ir.order import UpdateOrder
from .context import G, H, Step
from .gradients import TiedGrads
from .optim.base import HostOptimizer
from .optim.clipping import GradNormTracker, squared_norm
from .store import HostStore
from .streams import Streams


def check_clipping(order: UpdateOrder, max_grad_norm: float | None) -> None:
    """Refuse a clipping optimizer when an update runs before the global norm is known."""
    if max_grad_norm is not None and not order.norm_first:
        raise PlanError("the optimizer clips gradients (max_grad_norm set) but this plan updates some blocks "
                        "before the whole backward is done, when the global norm is not known yet: compile "
                        "the plan with clip=True")


class Updates:
    """Owns everything about ``update`` ops for one trainer (see the module docstring)."""

    def __init__(self, order: UpdateOrder, *, streams: Streams, optimizer: HostOptimizer, tracker: GradNormTracker,
                 store: HostStore, resident_grad: dict[int, torch.Tensor], gpu_updated: frozenset = frozenset()):
        self.order = order
        self.lagged = order.lagged                # owners whose update applies the previous step's gradients
        self.norm_first = order.norm_first
        self.streams, self.optimizer, self.tracker, self.store = streams, optimizer, tracker, store
        self.resident_grad = resident_grad        # owner -> fp32 GPU accumulator of a resident block
        self.tied = TiedGrads(store)
        self.gpu_updated = gpu_updated             # streamed blocks updated on the GPU (``gpu_update.py``)
        self.kept: dict[int, torch.Tensor] = {}   # ... their accumulators between two steps
        #: the data-parallel world (``distributed.World``): the norm is then summed over its ranks
        self.world = None
        #: the state the plan keeps on NVMe (``nvme_state.NvmeState``), set by the trainer; None: none
        self.nvme_state = None
        # ---- carried across steps
        self.pending: set[int] = set()            # owners whose last-step gradients await their lagged update
        self.pending_coef: float | None = None
        self.pending_lr: float | None = None      # the optimizer's lr when the pending gradients' step began
        self.step_lr: float | None = None         # ... when this step began
        self._futures: dict[int, Future] = {}     # update op id -> its latest host work

    def takes_norm(self, op: Op) -> bool:
        """Does ``op`` take the step's global norm on the issuing thread (a same-step host update)?"""
        return self.order.takes_norm(op)

    def future(self, op_id: int) -> Future | None:
        """The host work of update ``op_id`` last submitted (the previous step's, until this one's)."""
        return self._futures.get(op_id)

    # ---- a step -----------------------------------------------------------------------------------
    def begin_step(self, lr: float | None, step: Step) -> None:
        self.step_lr = lr                         # this step's gradients are applied at this rate
        # an assembled tied gradient is last step's: only a lagged update (of last step's) may use it
        self.tied.ready &= self.lagged
        for o, acc in self.kept.items():          # the accumulators GPU-updated blocks' updates apply
            step.put(tensor_id(TensorKind.GRADS, o), G, acc)
        self.kept = {}

    def carry(self, step: Step) -> None:
        """At the step's end (its norm taken): keep the GPU-updated blocks' accumulators for the next step."""
        for o in self.gpu_updated:
            acc = step.copies.pop((tensor_id(TensorKind.GRADS, o), G), None)
            if acc is not None:
                self.kept[o] = acc

    def run(self, step: Step, op: Op) -> None:
        """The ``update`` handler."""
        o = op.block
        if o in self.gpu_updated:
            apply = o in self.pending
            self.pending.discard(o)
            step.begin(op, Resource.GPU)
            acc = step.copies.pop((tensor_id(TensorKind.GRADS, o), G), None)
            if apply and acc is not None:
                params = step.get(tensor_id(TensorKind.PARAMS, o), G)
                state = step.get(tensor_id(TensorKind.OPT_STATE, o), G)
                with self.streams.on(Resource.GPU):
                    self.optimizer.step_streamed(o, acc, params.flat[:acc.numel()], state, self.pending_coef,
                                                 self.pending_lr)
            step.end(op, Resource.GPU)
            return
        if o in self.resident_grad:
            apply = o in self.pending
            self.pending.discard(o)
            step.begin(op, Resource.GPU)
            self._resident_step(o, self.pending_coef if apply else None, self.pending_lr)
            step.end(op, Resource.GPU)
            return
        placed = self.nvme_state is not None and o in self.nvme_state.blocks
        grads = step.take(tensor_id(TensorKind.GRADS, o), H) if placed and self.nvme_state.has(TensorKind.GRADS, o) \
            else None                             # a host copy of a gradient kept on NVMe: the update drops it
        if o in self.lagged:
            if o not in self.pending:             # first step, a skipped step, or after flush(): nothing to apply
                self._skip(step, op, grads)
                return
            self.pending.discard(o)
            coef, lr = self.pending_coef, self.pending_lr
        else:
            coef, lr = (self.coefficient(step) if self.norm_first else 1.0), self.step_lr
        if coef is None:                          # non-finite gradient norm: the step is skipped
            self._skip(step, op, grads)
            return
        if placed:
            work = self._placed_work(step, o, grads, coef, lr)
        else:
            def work():
                self.optimizer.step(o, self.tied.grad(o), coef, lr)
        step.submit(self.streams.cpu, op, work)
        self._futures[op.id] = step.done[op.id]
        if grads is not None:
            self.nvme_state.pool.release(grads["buf"].buf, [step.done[op.id]])

    def _skip(self, step: Step, op: Op, grads: dict | None) -> None:
        """An update with nothing to apply; a placed gradient's host copy goes back to the pool after its read.  A
        block with state on NVMe completes only after its dependencies, its state reads: the ops after it wait for
        them through it (a load of the parameters depends on the update that last changed them, not on the read)."""
        if self.nvme_state is not None and op.block in self.nvme_state.blocks:
            step.submit(self.streams.cpu, op, lambda: None)
        else:
            step.done[op.id] = None
        if grads is not None:
            self.nvme_state.pool.release(grads["buf"].buf, [step.done[op.id], *step.dep_handles(op)])

    def _placed_work(self, step: Step, o: int, grads: dict | None, coef: float, lr: float | None):
        """The host work of an update of a block with state on NVMe: ``step_streamed`` on the host copies the
        plan's ``state_read`` ops made (the host store's own tensors for a component not placed)."""
        ns, opt = self.nvme_state, self.optimizer
        grad = grads["buf"].tensor[:self.store.layouts[o].trainable_numel] if grads is not None else self.tied.grad(o)
        params = step.get(tensor_id(TensorKind.PARAMS, o), H)["buf"].tensor if ns.has(TensorKind.PARAMS, o) \
            else self.store.load[o]
        state = step.get(tensor_id(TensorKind.OPT_STATE, o), H)["state"] if ns.has(TensorKind.OPT_STATE, o) \
            else opt.streamed_state(o)
        return lambda: opt.step_streamed(o, grad, params, state, coef, lr)

    def coefficient(self, step: Step) -> float | None:
        """The step's clip coefficient (its global gradient norm, taken once): device norms plus tied
        parameters' on the host.  None when the step must be skipped (non-finite norm)."""
        if step.norm_done:
            return step.coef
        Streams.wait_on_host([step.done.get(i) for i in self.order.grad_offloads.values()])
        self.tracker.begin_step()
        # resident accumulators hold whole gradients, tied shares included (with several ranks, this rank's
        # shard of them, which the reduce-scatters on the collective stream added)
        # the reductions and their one read on the same stream: read from another (the caller's), the norms
        # of the accumulators just enqueued would race their kernels [ledger: norm-read-stream]; the gradient
        # offloads' norms, on the D2H stream, are complete (waited above)
        with self.streams.on(Resource.GPU if self.world is None else Resource.NET):
            for o, acc in self.resident_grad.items():
                step.grad_sq[o] = squared_norm(acc)
            for o in self.gpu_updated:            # as ``grad_offload`` takes it (no tied parameters here)
                acc = step.copies.get((tensor_id(TensorKind.GRADS, o), G))
                if acc is not None:
                    step.grad_sq[o] = squared_norm(acc)
            on_device = [j for j in range(len(self.store.layouts)) if step.grad_sq.get(j) is not None]
            sqs = dict(zip(on_device, torch.stack([step.grad_sq[j].double() for j in on_device]).tolist())) \
                if on_device else {}
        totals = {}
        for j, lay in enumerate(self.store.layouts):      # one device->host read for every block's norm
            sq = sqs.get(j)
            total = 0.0 if sq is None else sq
            tied = bool(lay.shared) and j not in self.resident_grad
            if tied:
                # with a global norm the owner's update comes after this and reuses the sum; without
                # one it may be running now on the update worker, reading the buffer: use a new one
                _, seg_sq = self.tied.sum(j, reuse=self.norm_first)
                if self.norm_first:
                    self.tied.ready.add(j)
                total += sum(seg_sq)
            if sq is not None or tied:
                totals[j] = total
        if self.world is not None:       # each rank holds a shard of every block: sum the ranks' squares
            totals = dict(zip(totals, self.world.sum_floats(list(totals.values()), "all_reduce of the gradient "
                                                                                  "norms")))
        for j, total in totals.items():
            self.tracker.add(j, total)
        step.coef = self.tracker.finish_step()
        step.norm_done = True
        return step.coef

    def end_step(self, coef: float | None) -> bool:
        """Record this step's gradients for the lagged updates of the next; returns whether the step's
        updates were skipped (a non-finite norm in a norm-first plan)."""
        skipped = coef is None and self.norm_first
        self.pending = set() if coef is None else set(self.lagged)
        self.pending_coef, self.pending_lr = coef, self.step_lr
        return skipped

    # ---- between steps ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply the pending lagged updates now and wait for every update."""
        coef, lr = self.pending_coef, self.pending_lr
        kept, self.kept = self.kept, {}           # applied now if pending, else dropped (a skipped step's)
        if self.pending and coef is not None:
            futures = []
            self.streams.synchronize()
            for o in sorted(self.pending):
                if o in self.gpu_updated:         # on the host, from the accumulator: the host store's state
                    if o in kept:
                        futures.append(self.streams.cpu.submit(self._kept_step, o, kept[o].to("cpu"), coef, lr))
                elif o in self.resident_grad:
                    self._resident_step(o, coef, lr)
                elif self.nvme_state is not None and o in self.nvme_state.blocks:     # one block at a time
                    self._placed_flush(o, coef, lr)
                else:
                    futures.append(self.streams.cpu.submit(self._host_step, o, coef, lr))
            self.streams.synchronize()
            for f in futures:
                f.result()
        self.pending = set()
        for fut in list(self._futures.values()):
            fut.result()
        self._futures.clear()

    def close(self) -> None:
        self.tied.close()

    def _host_step(self, o: int, coef: float, lr: float | None) -> None:
        try:
            self.optimizer.step(o, self.tied.grad(o), coef, lr)
        except Exception as e:
            raise RuntimeError(f"while applying block {o}'s pending update (flush): {e}") from e

    def _placed_flush(self, o: int, coef: float, lr: float | None) -> None:
        """A pending update of a block with state on NVMe, between steps: its state brought in, updated, written
        back."""
        try:
            with self.nvme_state.installed(o, write_back=True, grads=True):
                self.optimizer.step(o, self.tied.grad(o), coef, lr)
        except Exception as e:
            raise RuntimeError(f"while applying block {o}'s pending update (flush): {e}") from e

    def _kept_step(self, o: int, grad: torch.Tensor, coef: float, lr: float | None) -> None:
        try:
            self.optimizer.step(o, grad, coef, lr)
        except Exception as e:
            raise RuntimeError(f"while applying GPU-updated block {o}'s pending update (flush): {e}") from e

    def _resident_step(self, o: int, coef: float | None, lr: float | None) -> None:
        """A resident block's update on the GPU stream, from its GPU accumulator, which is then zeroed
        for this step's backward.  ``coef`` None (first step, skipped step): nothing to apply, but the
        accumulator is cleared all the same (it may hold a skipped step's non-finite gradients)."""
        acc = self.resident_grad[o]
        with self.streams.on(Resource.GPU):
            if coef is not None:
                self.optimizer.step(o, acc, coef, lr)
            acc.zero_()


def update(ctx: Step, op: Op) -> None:
    """The ``update`` handler: ``Updates.run``."""
    ctx.run.updates.run(ctx, op)
