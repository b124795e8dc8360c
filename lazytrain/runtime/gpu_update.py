"""GPU-updated streamed blocks at run time (``Decisions.gpu_update``): the ``state_load`` and ``state_store``
handlers, and the setup of their host state.

The block's parameters and optimizer state live in the host store as any streamed block's.  ``state_load``
copies its load buffer and the optimizer's ``streamed_state`` to the GPU (``params[j]``, which its forward then
reads, and ``ostate[j]``); the ``update`` (``updates.Updates.run``) applies the accumulator the previous step's
backward left on the GPU with ``step_streamed``; ``state_store`` copies state and new parameters back, so the
backward's ``load`` and a checkpoint read them from the host.  The accumulator carries across steps in
``Updates.kept``; ``flush`` applies a pending one on the host."""

from __future__ import annotations

import torch

from ..ir import Op, PlanError, Resource, TensorKind
from ..ir.ops import tensor_id
from .context import G, GpuParams, Step
from .handlers import assemble
from .pinned import host_empty


def pin_state(plan, optimizer, *, pin: bool) -> None:
    """Put each GPU-updated block's optimizer state in page-locked buffers (on CUDA), refusing an optimizer that
    cannot update a streamed block on the GPU."""
    for j in sorted(plan.decisions.gpu_updated_blocks):
        try:
            optimizer.pin_streamed_state(j, lambda n, dtype: host_empty(n, dtype, pin=pin))
        except NotImplementedError as e:
            raise PlanError(f"the plan updates streamed blocks on the GPU (decisions.gpu_update) but {e}: compile "
                            "it with gpu_update=0") from None


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy on ``device`` (a copy on the CPU too: CPU mode must not alias the host store)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=True)
    return out


def state_load(ctx: Step, op: Op) -> None:
    """Block j's parameters and optimizer state host -> GPU, for its update and its forward."""
    j, run = op.block, ctx.run
    lay = run.store.layouts[j]
    ctx.begin(op, Resource.H2D)       # after the previous step's state_store (the step boundary) and its update
    with run.streams.on(Resource.H2D):
        flat = assemble(lay, run.store.load, run.device, run.store.param_dtype, run.store)  # (a quantized base: too)
        state = {k: _to_device(v, run.device) for k, v in run.optimizer.streamed_state(j).items()}
    for t in (flat, *state.values()):           # read by the update (GPU) and the store (D2H)
        run.streams.keep_alive(t, Resource.GPU)
        run.streams.keep_alive(t, Resource.D2H)
    views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments}
    ctx.put(tensor_id(TensorKind.PARAMS, j), G, GpuParams(flat, views))
    ctx.put(tensor_id(TensorKind.OPT_STATE, j), G, state)
    ctx.end(op, Resource.H2D)


def state_store(ctx: Step, op: Op) -> None:
    """Block j's updated state and parameters GPU -> host store; the parameters stay for the forward."""
    j, run = op.block, ctx.run
    ctx.begin(op, Resource.D2H)
    params: GpuParams = ctx.get(tensor_id(TensorKind.PARAMS, j), G)
    state = ctx.take(tensor_id(TensorKind.OPT_STATE, j), G)
    with run.streams.on(Resource.D2H):
        for k, host in run.optimizer.streamed_state(j).items():
            host.copy_(state[k], non_blocking=True)
        n = run.store.layouts[j].trainable_numel     # (a frozen parameter is never updated)
        run.store.load[j][:n].copy_(params.flat[:n], non_blocking=True)
    ctx.end(op, Resource.D2H)
