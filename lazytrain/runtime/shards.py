"""ZeRO-3-style sharding of the host state (``ir.sharding``): the layouts, initial shards and the
gathered master weights.

Two layouts per block when the world has N > 1 ranks:

- the *gathered* layout (``Run.gpu_layouts``): what ``all_gather`` assembles on the GPU and what
  backward accumulates into, every tensor at an ``ALIGN``-aligned offset, padded to N shards;
- the *shard* layout (``HostStore.layouts``): this rank's ``[r * S, (r + 1) * S)`` of it, with one
  segment per piece of a tensor that falls in it (offset in the shard, the piece's size, the whole
  tensor's shape, so the 8-bit optimizer classifies a piece as it does the tensor).

The host store, the optimizer and ``grad_offload`` see only the shard layout, so they run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir import ModelGraph
from ..ir.sharding import aligned_offsets, shard_numel
from .store import BlockLayout, Segment


@dataclass
class PaddedLayout(BlockLayout):
    """A block layout whose flat buffer is longer than its tensors (alignment and shard padding)."""

    length: int = 0

    @property
    def numel(self) -> int:
        return self.length


def gathered_layouts(graph: ModelGraph, world_size: int) -> list[PaddedLayout]:
    """Every block's gathered layout (untied graphs only: ``compiler.world.check_world``)."""
    out = []
    for b in graph.blocks:
        offs, _ = aligned_offsets([p.numel for p in b.params])
        n = world_size * shard_numel([p.numel for p in b.params], world_size)
        segs = [Segment(p.name, o, p.numel, tuple(p.shape)) for p, o in zip(b.params, offs)]
        out.append(PaddedLayout(b.index, segs, n, n, length=n))
    return out


def pieces(lay: BlockLayout, world_size: int, rank: int) -> list[tuple[Segment, int, int]]:
    """(tensor, first, end) of every piece of a tensor in rank ``rank``'s shard, in shard order:
    elements ``[first, end)`` of the tensor (flat)."""
    s = lay.numel // world_size
    lo, hi = rank * s, (rank + 1) * s
    out = []
    for seg in lay.segments:
        a, b = max(seg.offset, lo), min(seg.offset + seg.numel, hi)
        if a < b:
            out.append((seg, a - seg.offset, b - seg.offset))
    return out


def shard_layouts(gathered: list[PaddedLayout], world_size: int, rank: int) -> list[PaddedLayout]:
    out = []
    for lay in gathered:
        s = lay.numel // world_size
        segs = [Segment(seg.name, seg.offset + a - rank * s, b - a, seg.shape)
                for seg, a, b in pieces(lay, world_size, rank)]
        out.append(PaddedLayout(lay.index, segs, s, s, length=s))
    return out


def init_shards(named: dict[str, torch.Tensor], gathered: list[PaddedLayout], shards: list[PaddedLayout],
                world_size: int, rank: int, optimizer, buffers: list[torch.Tensor]) -> None:
    """Each block's shard of its initial parameters into its load buffer, and the optimizer's state
    for it (padding is zero, and stays zero: its gradient is zero)."""
    for lay, sh in zip(gathered, shards):
        s = sh.numel
        init = torch.zeros(s, dtype=torch.float32)
        for seg, a, b in pieces(lay, world_size, rank):
            at = seg.offset + a - rank * s
            init[at:at + b - a].copy_(named[seg.name].detach().reshape(-1)[a:b])
        buffers[lay.index].copy_(init)
        optimizer.setup(lay.index, init, buffers[lay.index], sh.opt_segments())


def gathered_masters(world, gathered: list[PaddedLayout], master) -> dict[str, torch.Tensor]:
    """The fp32 master weights by parameter name, assembled from every rank's shard (a collective:
    every rank calls it).  ``master(j)``: this rank's flat shard of block j."""
    out = {}
    for lay in gathered:
        full = torch.empty(lay.numel, dtype=torch.float32, device=world.device)
        world.all_gather(full, master(lay.index).to(world.device, torch.float32), f"gathering block {lay.index}'s "
                         "master weights")
        full = full.cpu()
        for seg in lay.segments:
            out[seg.name] = full[seg.offset:seg.offset + seg.numel].view(seg.shape).clone()
    return out
