"""What a block's backward needs, kept by the runtime: ``SavedRecord`` and the packing of saved tensors.

A saved tensor is packed into ``saved[j] mb``'s entries, one per storage, so offload and reload move exactly
those bytes; a view of the block's parameter buffer is packed as a reference that unpacks to whatever buffer
is loaded at the backward (parameters are freed and loaded again in between).  Eager blocks pack through
``saved_tensors_hooks`` (``handlers``), compiled blocks the saved list their forward returns
(``compiled_block``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks


@dataclass
class SavedRecord:
    """What backward of block j, micro-batch m needs besides the saved storages.

    ``roots``: (output name, gradient edge, shape, dtype) of every output that needs a gradient;
    ``direct``: outputs that are an input unchanged (their gradient goes straight to the input);
    ``leaves``/``params``: the leaf tensors whose gradients backward returns.  Leaves keep their
    autograd identity but their data is swapped for a zero-stride scalar after the forward
    (``_release``), so the graph holds no activation or parameter memory of its own: every byte
    backward reads is in ``copies[saved[j] mb]`` (moved by offload/reload) or the loaded params.
    """

    block: int
    roots: list = field(default_factory=list)
    direct: dict[str, str] = field(default_factory=dict)
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict | None = None          # set for the duration of backward
    param_flats: tuple[torch.Tensor, ...] | None = None
    #: a compiled block's saved list, packed (``Packer.pack``; ``compiled_block``): None for an eager block,
    #: whose autograd graph holds the packed handles
    handles: list | None = None



class Packer:
    """Packs every tensor saved for block j's backward into ``entries`` (deduplicated by storage), or, for views
    of the block's parameter buffers, into a reference that unpacks to whatever buffer is loaded then.  Eager
    blocks pack through ``saved_tensors_hooks``, compiled blocks their forward's saved list (``compiled_block``)."""

    def __init__(self, rec: SavedRecord, entries: dict, param_flats: tuple[torch.Tensor, ...]):
        self.rec, self.entries = rec, entries
        self.pstores = {f.untyped_storage().data_ptr(): i for i, f in enumerate(param_flats)}
        self.device = param_flats[0].device
        self.by_ptr: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        i = self.pstores.get(ptr)
        if i is not None and t.device == self.device:
            return ("param", i, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if t.layout is not torch.strided or ptr == 0:
            k = len(self.entries)
            self.entries[k] = t
            return ("whole", k)
        k = self.by_ptr.get(ptr)
        if k is None:
            k = self.by_ptr[ptr] = len(self.entries)
            self.entries[k] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        return ("view", k, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(self, h):
        return unpack(self.rec, h)

    def hooks(self):
        return saved_tensors_hooks(self.pack, self.unpack)


def unpack(rec: SavedRecord, h) -> torch.Tensor:
    """A packed saved tensor (``Packer.pack``) from what backward has: the loaded parameters, ``saved[j]``."""
    if h[0] == "param":
        if rec.param_flats is None:
            raise RuntimeError(f"block {rec.block}'s parameters are not loaded for its backward")
        _, i, dt, shape, stride, off = h
        return rec.param_flats[i].view(dt).as_strided(shape, stride, off)
    if rec.entries is None:
        raise RuntimeError(f"saved[{rec.block}] is not on the GPU for its backward")
    if h[0] == "whole":
        return rec.entries[h[1]]
    _, k, dt, shape, stride, off = h
    return rec.entries[k].view(dt).as_strided(shape, stride, off)
