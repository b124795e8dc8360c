"""Handlers of the collective ops (``ir.sharding``), on the collective stream (``Resource.NET``).

``all_gather j``: every rank's shard of block j's parameters (``pshard[j]``, what ``load`` copied) into
one flat buffer in the gathered layout (``shards.gathered_layouts``), each parameter a view of it, as
``load`` leaves them in a world of one.  ``reduce_scatter j``: the fp32 gradient accumulator summed over
the ranks, this rank's slice kept (``gshard[j]``, what ``grad_offload`` then moves).  ``all_reduce``:
the step's global gradient norm (``updates.Updates.coefficient`` sums the ranks' squared norms).
Each runs once per section of the block (``shards.gather`` / ``shards.scatter``: a tied parameter is a
section of its own).  A resident block keeps its shard on the GPU (``Run.resident_shards``): its
``all_gather`` reads it there and its ``reduce_scatter`` adds into its resident accumulator.

On a GPU the NCCL call is issued with the collective stream current: NCCL's own stream waits for it,
and the stream waits for NCCL's work, so the event ``Step.end`` records marks the collective's end.
"""

from __future__ import annotations

import torch

from ..ir import Op, Resource, TensorKind
from ..ir.ops import tensor_id
from .context import G, GpuParams, Step
from .handlers import assemble
from .shards import gather, scatter


def all_gather(ctx: Step, op: Op) -> None:
    j = op.block
    run = ctx.run
    lay = run.gpu_layouts[j]
    ctx.begin(op, Resource.NET)
    with run.streams.on(Resource.NET):
        if j in run.resident_shards:     # a resident block's shard (its tied links from their owners') stays
            shard = assemble(run.store.layouts[j], run.resident_shards, run.device, run.store.param_dtype)
        else:
            shard = ctx.take(tensor_id(TensorKind.PARAM_SHARD, j), G)
        flat = torch.empty(lay.numel, dtype=shard.dtype, device=run.device)
        gather(run.world, flat, shard, lay, f"all_gather of block {j} (op #{op.id})")
    run.streams.keep_alive(shard, Resource.NET)
    run.streams.keep_alive(flat, Resource.GPU)
    views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments}
    ctx.put(tensor_id(TensorKind.PARAMS, j), G, GpuParams(flat, views))
    ctx.end(op, Resource.NET)


def reduce_scatter(ctx: Step, op: Op) -> None:
    """This rank's shard of the block's gradient summed over the ranks: ``gshard[j]``, or for a resident
    block added into the resident accumulators (its own, and its tied links' owners')."""
    j = op.block
    run = ctx.run
    ctx.begin(op, Resource.NET)
    acc = ctx.take(tensor_id(TensorKind.GRADS, j), G)
    shard_lay = run.store.layouts[j]
    with run.streams.on(Resource.NET):
        out = torch.empty(shard_lay.numel, dtype=acc.dtype, device=run.device)
        scatter(run.world, out, acc, run.gpu_layouts[j], f"reduce_scatter of block {j} (op #{op.id})")
        if j in run.resident_shards:
            into = run.updates.resident_grad
            into[j][:shard_lay.owned_numel] += out[:shard_lay.owned_numel]
            for seg, owner, off in shard_lay.links:
                into[owner][off:off + seg.numel] += out[seg.offset:seg.offset + seg.numel]
    run.streams.keep_alive(acc, Resource.NET)
    if j not in run.resident_shards:
        ctx.put(tensor_id(TensorKind.GRAD_SHARD, j), G, out)
    ctx.end(op, Resource.NET)


def all_reduce(ctx: Step, op: Op) -> None:
    """The global gradient norm, summed over the ranks (it waits for this rank's gradient offloads, and
    on the collective stream for the resident blocks' reduce-scatters)."""
    ctx.begin(op, Resource.NET)
    ctx.run.updates.coefficient(ctx)
    ctx.end(op, Resource.NET)
