"""ZeRO-3-style sharding of the host state (``ir.sharding``): the layouts, initial shards and the
gathered master weights.

Two layouts per block when the world has N > 1 ranks:

- the *gathered* layout (``Run.gpu_layouts``): what ``all_gather`` assembles on the GPU and what
  backward accumulates into, every tensor at an ``ALIGN``-aligned offset, padded to N shards;
- the *shard* layout (``HostStore.layouts``): this rank's ``[r * S, (r + 1) * S)`` of it, with one
  segment per piece of a tensor that falls in it (offset in the shard, the piece's size, the whole
  tensor's shape, so the 8-bit optimizer classifies a piece as it does the tensor).

The host store, the optimizer and ``grad_offload`` see only the shard layout, so they run unchanged.
A block is made of sections (``ir.sharding.block_sections``: one for an untied block; a tied
parameter is a section of its own in its owner and in each reader); every "rank's slice" above is
then taken per section, and the collectives run once per section (``gather``, ``scatter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ir import ModelGraph
from ..ir.sharding import aligned_offsets, block_sections, shard_numel
from .store import BlockLayout, Segment


@dataclass
class PaddedLayout(BlockLayout):
    """A block layout whose flat buffer is longer than its tensors (alignment and shard padding), made of
    ``sections`` (``ir.sharding.block_sections``): (first element, length, owner block) of each."""

    length: int = 0
    sections: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.length


def gathered_layouts(graph: ModelGraph, world_size: int) -> list[PaddedLayout]:
    """Every block's gathered layout: its sections one after the other, each padded to ``world_size``
    equal shards; ``owned_numel`` covers the sections of parameters it updates (its tied links last),
    ``plain_numel`` the first when no other block reads it."""
    out = []
    for b, secs in zip(graph.blocks, block_sections(graph)):
        segs, sections, at, owned = [], [], 0, 0
        for sec in secs:
            offs, _ = aligned_offsets([p.numel for p in sec])
            n = world_size * shard_numel([p.numel for p in sec], world_size)
            segs += [Segment(p.name, at + o, p.numel, tuple(p.shape)) for p, o in zip(sec, offs)]
            sections.append((at, n, sec[0].owner))
            owned += n if sec[0].owner == b.index else 0
            at += n
        tied = {p.name for c in graph.blocks if c.index != b.index for p in c.params if p.owner == b.index}
        plain = sections[0][1] if secs and secs[0][0].owner == b.index and secs[0][0].name not in tied else 0
        out.append(PaddedLayout(b.index, segs, owned, plain, length=at, sections=sections))
    return out


def owned_pieces(lay: PaddedLayout, world_size: int, rank: int) -> list[tuple[Segment, int, int]]:
    """(tensor, first, end) of every piece of a tensor the block updates in rank ``rank``'s shard, in shard
    order: elements ``[first, end)`` of the tensor (flat); what its checkpoint file holds (tied links are
    their owner's)."""
    return [(seg, a, b) for seg, a, b, at in _placed(lay, world_size, rank) if at < lay.owned_numel // world_size]


def _placed(lay: PaddedLayout, world_size: int, rank: int) -> list[tuple[Segment, int, int, int]]:
    """Every piece of a tensor in rank ``rank``'s shard (links included), with its offset in the shard."""
    out, base = [], 0
    for first, n, _owner in lay.sections:
        s = n // world_size
        lo, hi = first + rank * s, first + (rank + 1) * s
        for seg in lay.segments:
            a, b = max(seg.offset, lo), min(seg.offset + seg.numel, hi)
            if a < b:
                out.append((seg, a - seg.offset, b - seg.offset, base + a - lo))
        base += s
    return out


def shard_layouts(gathered: list[PaddedLayout], world_size: int, rank: int) -> list[PaddedLayout]:
    """Rank ``rank``'s shard of every block: its slice of each section, in order.  A tied section's
    slice is linked as ``store.layouts`` links a tied tensor (the same elements in the owner's shard and
    in the reader's), so ``load`` and ``gradients.TiedGrads`` work on shards as on whole blocks."""
    out = []
    for lay in gathered:
        segs = [Segment(seg.name, at, b - a, seg.shape) for seg, a, b, at in _placed(lay, world_size, rank)]
        out.append(PaddedLayout(lay.index, segs, lay.owned_numel // world_size, lay.plain_numel // world_size,
                                length=lay.numel // world_size,
                                sections=[(f // world_size, n // world_size, o) for f, n, o in lay.sections]))
    slot = {}      # (block, first tensor of a section) -> the rank's slice of that section, as a segment
    for lay, sh in zip(gathered, out):
        for (first, n, _o), (f, m, _) in zip(lay.sections, sh.sections):
            seg = next(s for s in lay.segments if first <= s.offset < first + n)
            slot[(lay.index, seg.name)] = Segment(seg.name, f, m, seg.shape)
    for lay, sh in zip(gathered, out):
        for first, n, owner in lay.sections:
            if owner == lay.index:
                continue
            here = slot[(lay.index, next(s.name for s in lay.segments if first <= s.offset < first + n))]
            there = slot[(owner, here.name)]
            sh.links.append((here, owner, there.offset))
            ent = next((e for e in out[owner].shared if e[0] is there), None)
            if ent is None:
                ent = (there, [])
                out[owner].shared.append(ent)
            ent[1].append((lay.index, here.offset))
    return out


def init_shards(weights, gathered: list[PaddedLayout], shards: list[PaddedLayout], world_size: int, rank: int,
                optimizer, buffers) -> None:
    """Each block's shard of its initial parameters (the ones it updates; ``weights.piece``, see
    ``weights.py``) into its load buffer (host, or a resident block's GPU buffer: ``buffers[j]``), and the
    optimizer's state for it (padding is zero, and stays zero: its gradient is zero)."""
    for lay, sh in zip(gathered, shards):
        if not sh.owned_numel:
            continue
        init = torch.zeros(sh.owned_numel, dtype=torch.float32)
        for seg, a, b, at in _placed(lay, world_size, rank):
            if at < sh.owned_numel:
                init[at:at + b - a].copy_(weights.piece(seg.name, a, b))
        buffers[lay.index].copy_(init)
        optimizer.setup(lay.index, init, buffers[lay.index], sh.opt_segments())


def gather(world, full: torch.Tensor, shard: torch.Tensor, lay: PaddedLayout, what: str, *,
           owned: bool = False) -> None:
    """``full`` (the gathered layout, or its owned sections with ``owned``) from every rank's ``shard``:
    one all-gather per section, each rank's slice of it being where the shard layout puts it."""
    at = 0
    for first, n, owner in lay.sections:
        if owned and owner != lay.index:
            break
        s = n // world.size
        world.all_gather(full[first:first + n], shard[at:at + s], what)
        at += s


def scatter(world, out: torch.Tensor, full: torch.Tensor, lay: PaddedLayout, what: str) -> None:
    """``out`` (this rank's shard) = its slice of each section of ``full`` summed over the ranks."""
    at = 0
    for first, n, _owner in lay.sections:
        s = n // world.size
        world.reduce_scatter(out[at:at + s], full[first:first + n], what)
        at += s


def gathered_masters(world, gathered: list[PaddedLayout], master, keep: bool = True) -> dict[str, torch.Tensor]:
    """The fp32 master weights by parameter name, assembled from every rank's shard (a collective:
    every rank calls it).  ``master(j)``: this rank's flat shard of block j's owned parameters.  ``keep``
    False: take part, keep nothing (a rank that needs no copy holds one block at a time, not the model)."""
    out = {}
    for lay in gathered:
        if not lay.owned_numel:
            continue
        full = torch.empty(lay.owned_numel, dtype=torch.float32, device=world.device)
        gather(world, full, master(lay.index).to(world.device, torch.float32), lay,
               f"gathering block {lay.index}'s master weights", owned=True)
        if not keep:
            continue
        full = full.cpu()
        for seg in lay.segments:
            if seg.offset < lay.owned_numel:
                out[seg.name] = full[seg.offset:seg.offset + seg.numel].view(seg.shape).clone()
    return out
