"""Handlers of the collective ops (``ir.sharding``), on the collective stream (``Resource.NET``).

``all_gather j``: every rank's shard of block j's parameters (``pshard[j]``, what ``load`` copied) into
one flat buffer in the gathered layout (``shards.gathered_layouts``), each parameter a view of it, as
``load`` leaves them in a world of one.  ``reduce_scatter j``: the fp32 gradient accumulator summed over
the ranks, this rank's slice kept (``gshard[j]``, what ``grad_offload`` then moves).  ``all_reduce``:
the step's global gradient norm (``updates.Updates.coefficient`` sums the ranks' squared norms).

On a GPU the NCCL call is issued with the collective stream current: NCCL's own stream waits for it,
and the stream waits for NCCL's work, so the event ``Step.end`` records marks the collective's end.
"""

from __future__ import annotations

import torch

from ..ir import Op, Resource, TensorKind
from .context import G, GpuParams, Step, _tid


def all_gather(ctx: Step, op: Op) -> None:
    j = op.block
    run = ctx.run
    lay = run.gpu_layouts[j]
    ctx.begin(op, Resource.NET)
    shard = ctx.take(_tid(TensorKind.PARAM_SHARD, j), G)
    with run.streams.on(Resource.NET):
        flat = torch.empty(lay.numel, dtype=shard.dtype, device=run.device)
        run.world.all_gather(flat, shard, f"all_gather of block {j} (op #{op.id})")
    run.streams.keep_alive(shard, Resource.NET)
    run.streams.keep_alive(flat, Resource.GPU)
    views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments}
    ctx.put(_tid(TensorKind.PARAMS, j), G, GpuParams(flat, views))
    ctx.end(op, Resource.NET)


def reduce_scatter(ctx: Step, op: Op) -> None:
    j = op.block
    run = ctx.run
    ctx.begin(op, Resource.NET)
    acc = ctx.take(_tid(TensorKind.GRADS, j), G)
    with run.streams.on(Resource.NET):
        out = torch.empty(acc.numel() // run.world.size, dtype=acc.dtype, device=run.device)
        run.world.reduce_scatter(out, acc, f"reduce_scatter of block {j} (op #{op.id})")
    run.streams.keep_alive(acc, Resource.NET)
    ctx.put(_tid(TensorKind.GRAD_SHARD, j), G, out)
    ctx.end(op, Resource.NET)


def all_reduce(ctx: Step, op: Op) -> None:
    """The global gradient norm, summed over the ranks (it waits for this rank's gradient offloads)."""
    ctx.run.updates.coefficient(ctx)
    ctx.done[op.id] = None
