"""Data-parallel sharding of a block's flat parameters (ZeRO-3 style), as the plan and the runtime see it.

With ``world_size`` N > 1 every rank holds 1/N of each block's parameters, gradient buffer and
optimizer state on its host.  A block's flat buffer is laid out with every tensor (segment) starting
at a multiple of ``ALIGN`` elements and the whole padded to N equal shards of ``shard_numel``
elements, each a multiple of ``ALIGN``: rank r owns ``[r * shard, (r + 1) * shard)``.  Equal shards
are what ``all_gather`` and ``reduce_scatter`` need, and the gathered buffer *is* the block's flat
layout, so each parameter is a view of it as on one GPU.

Why ``ALIGN`` = 4096 elements: a shard boundary then falls on a quantization-block boundary of every
tensor for the 8-bit optimizer's block sizes (1024, 2048, 4096 all divide it), and a tensor under
``min_8bit_numel`` (4096 by default) is never cut, so each rank's optimizer does exactly the
arithmetic one process does on the same elements.  The padding costs at most 4095 elements per tensor
(0.05 % of a 7B layer's 233 M parameters, 7 tensors at most padded).

A tied parameter (read by several blocks, updated by its owner: ``ParamSpec.owner``) is a *section*
of its own in every block that reads it: a block's gathered buffer is a run of sections, each padded
to N equal shards, and a rank's shard of the block is its slice of every section, in order
(``block_sections``).  Rank r's slice of a tied section is then the same elements in the owner's
shard and in every reader's, so the reader's load copies it from the owner's host buffer (one copy of
the weight in the world), and after the ``reduce_scatter`` the reader's gradient slice adds to the
owner's element for element on the host (``runtime.gradients.TiedGrads``, as in one process).  An
untied block is one section: the layout above.

World size 1 uses none of this: the layout is the dense one of ``runtime.store.layouts``.
"""

from __future__ import annotations

from .graph import ModelGraph, ParamSpec

ALIGN = 4096


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def aligned_offsets(numels: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors of these sizes in a flat buffer where each starts at a multiple of ``ALIGN``,
    and the buffer's length (every tensor padded to a multiple of ``ALIGN``)."""
    offsets, off = [], 0
    for n in numels:
        offsets.append(off)
        off += _up(n, ALIGN)
    return offsets, off


def shard_numel(numels: list[int], world_size: int) -> int:
    """Elements of one rank's shard of a block whose tensors have these sizes."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return _up(-(-aligned_offsets(numels)[1] // world_size), ALIGN) if numels else 0


def padded_numel(numels: list[int], world_size: int) -> int:
    """Length of the gathered flat buffer: ``world_size`` shards (the dense sum for one rank)."""
    if world_size == 1:
        return sum(numels)
    return world_size * shard_numel(numels, world_size)


def block_sections(graph: ModelGraph) -> tuple[tuple[tuple[ParamSpec, ...], ...], ...]:
    """Per block, its sections in buffer order: the owned parameters no other block reads (one section,
    left out when empty), then one section per owned tied parameter, then one per tied parameter it reads
    from another block (the order of ``runtime.store.layouts``: owned first, links last)."""
    read_by: dict[tuple[int, str], int] = {}
    for b in graph.blocks:
        for p in b.params:
            read_by[(p.owner, p.name)] = read_by.get((p.owner, p.name), 0) + 1
    out = []
    for b in graph.blocks:
        plain = tuple(p for p in b.params if p.owner == b.index and read_by[(b.index, p.name)] == 1)
        tied = [(p,) for p in b.params if p.owner == b.index and read_by[(b.index, p.name)] > 1]
        links = [(p,) for p in b.params if p.owner != b.index]
        out.append(tuple(([plain] if plain else []) + tied + links))
    return tuple(out)


def sections_shard_numel(sections, world_size: int) -> int:
    """Elements of one rank's shard of a block made of these sections."""
    return sum(shard_numel([p.numel for p in sec], world_size) for sec in sections)


def sections_owned_shard_numel(sections, block: int, world_size: int) -> int:
    """Elements of one rank's shard of block ``block`` that it updates (its links excluded)."""
    return sum(shard_numel([p.numel for p in sec], world_size) for sec in sections if sec[0].owner == block)
