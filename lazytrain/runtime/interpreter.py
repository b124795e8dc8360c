"""The interpreter: one handler per op kind (``handlers.py``), run in program order.

Each handler issues its op onto its resource (a CUDA stream or a host worker) after making that
resource wait for the op's ``deps`` and leaves a completion handle in ``ctx.done``; the loop itself
never waits.  A failure names the op, as ``torch.fx.Interpreter`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..ir import Op, OpKind
from . import handlers as h
from .handlers import Ctx

HANDLERS: dict[OpKind, Callable[[Ctx, Op], None]] = {
    OpKind.LOAD: h.load,
    OpKind.COMPUTE: h.compute,
    OpKind.RECOMPUTE: h.recompute,
    OpKind.BACKWARD: h.backward,
    OpKind.OFFLOAD: h.offload,
    OpKind.RELOAD: h.reload,
    OpKind.GRAD_OFFLOAD: h.grad_offload,
    OpKind.UPDATE: h.update,
    OpKind.FREE: h.free,
}


def run(ctx: Ctx, ops: Iterable[Op]) -> None:
    for op in ops:
        try:
            HANDLERS[op.kind](ctx, op)
        except Exception as e:
            raise RuntimeError(f"while executing op #{op.id} ({h.describe(op)}): {e}") from e
