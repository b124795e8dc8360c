"""Host store: the per-block flat buffers the runtime owns, and a pool of pinned activation buffers.

Per block j (see ``runtime.optim.base`` for who owns what):

- the *load buffer*: the block's **owned** parameters, flat, in the plan's parameter dtype (what the
  optimizer writes after each update and ``load`` copies to the GPU);
- the *gradient buffer*: every parameter the block reads (owned and tied links), flat, in the host
  gradient dtype (fp32 for fp32 plans, else bf16: ``ir.semantics.Sizes``); ``grad_offload`` fills it.

Both are allocated once, up front, pinned when a GPU is used (allocating pinned memory on the fly
stalls streams).  A block's GPU layout is ``[owned & untied | owned & tied | tied links]``: the
first ``owned_numel`` elements mirror the load buffer, the first ``plain_numel`` are the parameters
whose gradient norm the device can take alone; a tied link is copied to the GPU straight from its
owner's load buffer, so the host keeps one copy of a tied weight.

Frozen parameters (``ParamSpec.trainable`` False: a LoRA base) come after the trainable ones of their group:
``[trainable owned (untied, tied) | frozen owned | trainable links | frozen links]``, so the optimizer's master
and state cover the prefix ``trainable_numel`` of the load buffer and the gradient (accumulator and host
buffer) the prefix ``grad_numel`` of the layout; a frozen parameter lives in the load buffer alone.

A quantized base (``base_bits`` 8 or 4): a block's load buffer is one byte buffer, the trainable prefix in the
parameter dtype (``load[j]``, what the optimizer writes) then, from a 16-byte boundary, the frozen segment packed
as a ``QuantizedSegment`` (``packed[j]``, its layout ``quant[j]``), filled once by ``fill_frozen``; a load copies
both and dequantizes the segment on the device (``handlers.assemble``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..ir import GiB, ModelGraph, TensorKind
from ..ir.semantics import QUANT_BLOCK
from .pinned import aligned_empty, host_empty
from .quantized import QuantizedSegment, pieces_of
from .streams import Streams

log = logging.getLogger("lazytrain")


class HostMemoryError(MemoryError):
    """The host store would not fit in the memory available now; raised before allocating."""


@dataclass
class HostCopy:
    """A host copy of a plan value in a pooled buffer (``HostPool``): the buffer, and the typed view of it."""

    buf: torch.Tensor            # pooled uint8 buffer
    tensor: torch.Tensor         # typed view of it


@dataclass
class Segment:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class BlockLayout:
    index: int
    segments: list[Segment]                 # GPU flat order
    owned_numel: int
    plain_numel: int
    #: tied links read by this block: (segment here, owner block, offset in the owner's layout)
    links: list[tuple[Segment, int, int]] = field(default_factory=list)
    #: owned tied parameters that train: (segment here, [(reader block, offset in the reader's layout)])
    shared: list[tuple[Segment, list[tuple[int, int]]]] = field(default_factory=list)
    #: the owned prefix that trains (optimizer state, master, update); None: all owned elements
    trainable: int | None = None
    #: the prefix the gradient covers (every trainable parameter read); None: the whole layout
    grads: int | None = None

    @property
    def trainable_numel(self) -> int:
        return self.owned_numel if self.trainable is None else self.trainable

    @property
    def grad_numel(self) -> int:
        return self.numel if self.grads is None else self.grads

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    def opt_segments(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """The owned segments that train, as ``HostOptimizer.setup`` wants them."""
        return [(s.name, s.offset, s.numel, s.shape) for s in self.segments if s.offset < self.trainable_numel]


def layouts(graph: ModelGraph, canonical: dict[str, str] | None = None) -> list[BlockLayout]:
    """Flat layouts of every block.  ``canonical`` maps a parameter name to the name of the tensor it
    is (tied parameters may appear under two names); by default names are their own canonical."""
    canon = canonical or {}

    def key(name: str) -> str:
        return canon.get(name, name)

    readers: dict[str, set[int]] = {}
    trains: dict[str, bool] = {}
    for b in graph.blocks:
        for p in b.params:
            readers.setdefault(key(p.name), set()).add(b.index)
            if p.owner == b.index:
                trains[key(p.name)] = p.trainable
    out: list[BlockLayout] = []
    for b in graph.blocks:
        own = [p for p in b.params if p.owner == b.index]
        plain = [p for p in own if p.trainable and len(readers[key(p.name)]) == 1]
        tied_own = [p for p in own if p.trainable and len(readers[key(p.name)]) > 1]
        frozen = [p for p in own if not p.trainable]
        foreign = [p for p in b.params if p.owner != b.index]
        links = [p for p in foreign if trains.get(key(p.name), True)] + \
            [p for p in foreign if not trains.get(key(p.name), True)]
        if frozen and len(links) and trains.get(key(links[0].name), True):
            raise ValueError(f"block {b.index} reads the tied parameter {links[0].name}, which trains, beside frozen "
                             f"parameters of its own: LoRA with a trained tied weight is not supported")
        segs, off, grads = [], 0, 0
        for p in plain + tied_own + frozen + links:
            segs.append(Segment(p.name, off, p.numel, tuple(p.shape)))
            off += p.numel
            if trains.get(key(p.name), True):
                grads = off
        owned = sum(p.numel for p in own)
        trainable = sum(p.numel for p in plain + tied_own)
        out.append(BlockLayout(b.index, segs, owned, sum(p.numel for p in plain), trainable=trainable, grads=grads))
    by_key = {(lay.index, key(s.name)): s for lay in out for s in lay.segments}
    for lay in out:
        b = graph.blocks[lay.index]
        for p in b.params:
            if p.owner != lay.index:
                here = by_key[(lay.index, key(p.name))]
                there = by_key.get((p.owner, key(p.name)))
                if there is None:
                    raise ValueError(f"block {lay.index} reads {p.name} owned by block {p.owner}, which does not "
                                     f"list it")
                lay.links.append((here, p.owner, there.offset))
                if not trains.get(key(p.name), True):
                    continue                # a frozen tied weight: read, but no gradient to sum
                owner = out[p.owner]
                ent = next((e for e in owner.shared if e[0] is there), None)
                if ent is None:
                    ent = (there, [])
                    owner.shared.append(ent)
                ent[1].append((lay.index, here.offset))
    return out


def mem_available() -> int:
    """``MemAvailable`` from /proc/meminfo (bytes); a large number where that file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def grad_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Host gradient dtype: fp32 for fp32 training, bf16 otherwise (``ir.semantics``)."""
    return torch.float32 if param_dtype == torch.float32 else torch.bfloat16


class HostStore:
    """Per-block load and gradient buffers (allocated in ``__init__``, once)."""

    def __init__(self, lays: list[BlockLayout], param_dtype: torch.dtype, *, pin: bool,
                 optimizer_bytes_per_param: float = 12.0, activation_bytes: int = 0,
                 resident: frozenset = frozenset(), placed: frozenset = frozenset(), announce=None,
                 base_bits: int = 16):
        self.layouts = lays
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype(param_dtype)
        self.pin = pin
        #: blocks that live on the GPU: no host buffers (their parameters never cross PCIe)
        self.resident = frozenset(resident)
        #: state kept on NVMe, as (tensor kind, block) pairs (``ir.semantics.Sizes.nvme``): no host buffer
        #: (``runtime/nvme_state.py`` makes its host copies; the plan's host peak, in ``activation_bytes``, has them)
        self.placed = frozenset(placed)
        #: each streamed block's frozen segment layout where the base is held quantized (``fill_frozen`` gives it
        #: its tensors, views of ``packed[j]``)
        self.quant: dict[int, QuantizedSegment] = {} if base_bits == 16 else {
            lay.index: frozen_segment(lay, base_bits, param_dtype) for lay in lays
            if lay.owned_numel > lay.trainable_numel and lay.index not in self.resident
            and (TensorKind.PARAMS, lay.index) not in self.placed}
        _check_links(lays, self.quant)
        need = self.estimate([lay for lay in lays if lay.index not in self.resident], param_dtype,
                             optimizer_bytes_per_param, activation_bytes, self.placed,
                             {j: q.nbytes for j, q in self.quant.items()})
        avail = mem_available()
        line = (f"lazytrain: host memory estimate {need['total'] / GiB:.2f} GiB (parameter and gradient buffers "
                f"{need['buffers'] / GiB:.2f}, optimizer {need['optimizer'] / GiB:.2f}, offloaded activations "
                f"{need['activations'] / GiB:.2f}); available {avail / GiB:.2f} GiB")
        log.info(line)
        if announce is not None:
            announce(line)            # before any allocation, so a user sees it even when it does not fit
        if need["total"] > avail:
            raise HostMemoryError(
                f"the host store needs about {need['total'] / GiB:.2f} GiB (parameter and gradient buffers "
                f"{need['buffers'] / GiB:.2f} GiB, optimizer master and state {need['optimizer'] / GiB:.2f} GiB, "
                f"offloaded activations {need['activations'] / GiB:.2f} GiB) but only {avail / GiB:.2f} GiB is "
                f"available (MemAvailable): use an 8-bit optimizer, offload activations to NVMe, or free memory")
        def host(n: int, dtype: torch.dtype, j: int, kind: TensorKind) -> torch.Tensor:
            return host_empty(0 if j in self.resident or (kind, j) in self.placed else n, dtype, pin=pin)
        self.load = [host(lay.owned_numel, param_dtype, lay.index, TensorKind.PARAMS) for lay in lays]
        #: a quantized block's frozen segment: its packed bytes, inside the block's one load buffer
        self.packed: dict[int, torch.Tensor] = {}
        pb = torch.empty((), dtype=param_dtype).element_size()
        for j, q in self.quant.items():
            head = -(-lays[j].trainable_numel * pb // 16) * 16
            buf = host_empty(head + q.nbytes, torch.uint8, pin=pin)
            self.load[j] = buf[:lays[j].trainable_numel * pb].view(param_dtype)
            self.packed[j] = buf[head:].zero_()        # (the gaps between sections too: the same bytes every run)
        self.grad = [host(lay.grad_numel, self.grad_dtype, lay.index, TensorKind.GRADS) for lay in lays]

    def fill_frozen(self, j: int, values: torch.Tensor, device: torch.device | None = None) -> None:
        """Quantize block j's frozen segment (``values``: flat, in the parameter dtype) into its packed buffer, on
        ``device`` (a GPU does NF4's nearest-code search in seconds where a CPU core takes ~0.7 s a Mi values)."""
        q = self.quant[j]
        fresh = QuantizedSegment.quantize(values, q.bits, q.block_size, q.pieces, device=device)
        self.quant[j] = QuantizedSegment(pieces=q.pieces, bits=q.bits, block_size=q.block_size, dtype=q.dtype,
                                         tensors=fresh.copy_into(self.packed[j]))

    def link_source(self, owner: int, offset: int, numel: int) -> torch.Tensor:
        """The host values of the parameter at ``offset`` of block ``owner``'s layout that another block reads (a tied
        link): its load buffer's, or where the owner's frozen segment is packed, its raw section's."""
        n = self.layouts[owner].trainable_numel
        if owner not in self.quant or offset < n:
            return self.load[owner][offset:offset + numel]
        q = self.quant[owner]
        piece = _piece_at(q, offset - n)
        at = sum(p.numel for p in q.pieces if p.offset < piece.offset and not p.quantized)
        return q.host_tensors()["raw"][at:at + numel]

    def frozen_values(self, j: int) -> torch.Tensor:
        """Block j's frozen parameters as the GPU sees them, flat in the parameter dtype (dequantized where the base
        is held quantized; else a view of the load buffer)."""
        if j in self.quant:
            return self.quant[j].dequantize()
        lay = self.layouts[j]
        return self.load[j][lay.trainable_numel:lay.owned_numel]

    @staticmethod
    def estimate(lays: list[BlockLayout], param_dtype: torch.dtype, optimizer_bytes_per_param: float,
                 activation_bytes: int, placed: frozenset = frozenset(),
                 packed: dict[int, int] | None = None) -> dict[str, int]:
        """Host bytes of the buffers, the optimizer and the offloaded activations, less the state on NVMe (a frozen
        parameter: its load buffer's bytes alone; ``packed``: a quantized block's frozen segment's bytes)."""
        pb = torch.empty((), dtype=param_dtype).element_size()
        gb = torch.empty((), dtype=grad_dtype(param_dtype)).element_size()
        packed = packed or {}
        owned = sum(lay.trainable_numel for lay in lays if (TensorKind.OPT_STATE, lay.index) not in placed)

        def load_bytes(lay: BlockLayout) -> int:
            if lay.index in packed:
                return lay.trainable_numel * pb + packed[lay.index]
            return lay.owned_numel * pb
        buffers = sum(load_bytes(lay) * ((TensorKind.PARAMS, lay.index) not in placed)
                      + lay.grad_numel * gb * ((TensorKind.GRADS, lay.index) not in placed) for lay in lays)
        opt = int(owned * optimizer_bytes_per_param)
        return {"buffers": buffers, "optimizer": opt, "activations": int(activation_bytes),
                "total": buffers + opt + int(activation_bytes)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.load + self.grad) + sum(
            t.numel() for t in self.packed.values())

    def frozen_nbytes(self) -> int:
        """Host bytes of the frozen parameters of the streamed blocks (packed where the base is quantized)."""
        pb = torch.empty((), dtype=self.param_dtype).element_size()
        return sum(self.packed[j].numel() if j in self.packed else
                   (lay.owned_numel - lay.trainable_numel) * pb * (self.load[j].numel() > 0)
                   for j, lay in enumerate(self.layouts))


def frozen_segment(lay: BlockLayout, bits: int, dtype: torch.dtype) -> QuantizedSegment:
    """The layout (no tensors yet) of block ``lay``'s frozen segment held at ``bits``: QLoRA's rule per parameter."""
    frozen = [(s.name, s.shape) for s in lay.segments if lay.trainable_numel <= s.offset < lay.owned_numel]
    return QuantizedSegment(pieces=pieces_of(frozen), bits=bits, block_size=QUANT_BLOCK, dtype=dtype, tensors={})


def _check_links(lays: list[BlockLayout], quant: dict[int, QuantizedSegment]) -> None:
    """A block may read a frozen tied parameter of a block whose base is quantized where the owner keeps it raw (an
    embedding tied to the head: QLoRA quantizes neither), from the owner's raw section (``HostStore.link_source``);
    a quantized one would need dequantizing from another block's buffer: refused."""
    for lay in lays:
        for seg, owner, off in lay.links:
            if owner in quant and off >= lays[owner].trainable_numel and \
                    _piece_at(quant[owner], off - lays[owner].trainable_numel).quantized:
                raise ValueError(f"block {lay.index} reads the frozen tied parameter {seg.name} of block {owner}, "
                                 "which a quantized base holds packed: train with --base-bits 16 for a model that "
                                 "ties its frozen weight matrices")


def _piece_at(q: QuantizedSegment, at: int):
    return next(p for p in q.pieces if p.offset == at)


class HostPool:
    """Host byte buffers for offloaded activations, reused by size.

    A released buffer carries the completion handles of its last readers (an in-flight H2D copy, an
    NVMe write); ``acquire`` hands it out again only after they are complete.  The op list repeats
    every step, so after the first step every request is served from the pool: pinned memory is
    allocated during step 1 only.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, list]]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            cands = self._free.get(nbytes, [])
            pick = None
            for i, (_, after) in enumerate(cands):
                if all(_is_done(h) for h in after):
                    pick = cands.pop(i)
                    break
            if pick is None and cands:
                pick = cands.pop(0)
        if pick is not None:
            Streams.wait_on_host(pick[1])
            return pick[0]
        with self._lock:
            self.allocated_bytes += nbytes
        return aligned_empty(nbytes, pin=self.pin)    # (page-aligned: NVMe moves it with direct I/O)

    def release(self, buf: torch.Tensor, after=()) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append((buf, [h for h in after if h is not None]))


def _is_done(h) -> bool:
    if h is None:
        return True
    if isinstance(h, Future):
        return h.done()
    return h.query()
