"""Optimizer state by tensor: what lets a checkpoint of N ranks load into M (``checkpoint_world.py``).

A block's optimizer state is flat over the block's buffer (one process: the dense layout of
``store.layouts``; a rank: its shard of the padded layout, ``shards.shard_layouts``).  ``split`` cuts
it into one piece per tensor (name -> state key -> elements ``[a, b)`` of that tensor); ``join`` puts
pieces back into the flat state of another layout.  Between the two, the pieces of a tensor from the
old ranks are concatenated (padding is dropped: it is not in any piece) and re-sliced.

How each state key is indexed (``KINDS``):

- ``elem``: one value per element of the flat buffer (the fp32 master, AdamW's moments);
- ``elem8`` / ``small``: one value per element of the tensors the 8-bit optimizer quantizes (codes
  ``mq``/``vq``) or keeps in fp32 (``m32``/``v32``), concatenated over those tensors in offset order;
- ``qblock``: one value per quantization block of ``block_size`` elements (``m_absmax``/``v_absmax``),
  a tensor's blocks starting at its piece's first element;
- ``step``: the step counter(s), the same for every element of the block.

Re-cutting ``qblock`` state is exact because a rank's piece of a tensor starts at a multiple of
``ir.sharding.ALIGN`` (4096) of the tensor (a tensor starts at an aligned offset and so does a shard),
every piece but a tensor's last is a multiple of it long, and ``block_size`` divides 4096: the pieces'
quantization blocks are the tensor's blocks in one process, and its codes, quantized against those
blocks' absmax, carry over unchanged.  A ``block_size`` that does not divide ``ALIGN`` is refused.
Which tensors are 8-bit depends on the whole tensor's size, so it is the same in every world.
"""

from __future__ import annotations

import math

import torch

from ..ir.sharding import ALIGN
from .manifest import CheckpointError

#: state key -> how it is indexed, per optimizer class that can be resharded
KINDS = {
    "TorchAdamW": {"master": "elem", "exp_avg": "elem", "exp_avg_sq": "elem", "step": "step"},
    "Hybrid8bitAdamW": {"master": "elem", "mq": "elem8", "vq": "elem8", "m32": "small", "v32": "small",
                        "m_absmax": "qblock", "v_absmax": "qblock", "step": "step"},
}

#: (name, offset in the flat buffer, elements of the piece, shape of the whole tensor)
Seg = tuple[str, int, int, tuple[int, ...]]


def check_reshardable(opt) -> None:
    """Refuse an optimizer whose state this module cannot re-cut (one line naming the fix)."""
    cls = type(opt).__name__
    if cls not in KINDS:
        raise CheckpointError(f"the state of optimizer {cls} cannot be resharded to another world size (only "
                              f"{', '.join(KINDS)}): resume with the world size it was saved with")
    if getattr(opt, "moment_bits", 8) == 4:
        raise CheckpointError("4-bit moments cannot be resharded to another world size (two codes a byte: a "
                              "piece's codes need not start at a byte): resume with the world size it was saved with")
    bs = getattr(opt, "block_size", None)
    if bs is not None and ALIGN % bs:
        raise CheckpointError(f"Hybrid8bitAdamW block_size {bs} does not divide the shard alignment {ALIGN}: its "
                              f"quantization blocks cannot be re-cut; resume with the world size it was saved with")


def _offsets(opt, segs: list[Seg]) -> list[tuple[Seg, str, int]]:
    """Each segment (offset order), its class (``elem8`` or ``small``) and where its state starts in
    the state tensors of that class (what ``Hybrid8bitAdamW.setup`` lays out); ``elem`` for AdamW."""
    out, q, s32 = [], 0, 0
    small_below = getattr(opt, "min_8bit_numel", None)
    for seg in sorted(segs, key=lambda x: x[1]):
        _name, _off, n, shape = seg
        if small_below is None:
            out.append((seg, "elem", 0))
        elif max(n, math.prod(shape)) < small_below:
            out.append((seg, "small", s32))
            s32 += n
        else:
            out.append((seg, "elem8", q))
            q += n
    return out


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


def split(opt, state: dict[str, torch.Tensor], segs: list[Seg]) -> dict[str, dict[str, torch.Tensor]]:
    """``state`` (flat, as ``opt.state_tensors`` returns it) cut into pieces: name -> key -> tensor."""
    kinds = KINDS[type(opt).__name__]
    bs = getattr(opt, "block_size", 1)
    out: dict[str, dict[str, torch.Tensor]] = {}
    step = state["step"].reshape(-1)
    step = step.max().reshape(1) if step.numel() else torch.zeros(1, dtype=step.dtype)
    for (name, off, n, _shape), cls, at in _offsets(opt, segs):
        piece = {}
        for key, kind in kinds.items():
            t = state[key].reshape(-1)
            if kind == "elem":
                lo, hi = off, off + n
            elif kind == cls:
                lo, hi = at, at + n
            elif kind == "qblock" and cls == "elem8":
                lo = _qblock_start(opt, segs, name)     # every earlier 8-bit tensor's blocks (``setup``'s s)
                hi = lo + _blocks(n, bs)
            elif kind == "step":
                piece[key] = step
                continue
            else:
                continue
            if hi > t.numel():
                raise CheckpointError(f"state {key} has {t.numel()} elements, the layout needs {hi}")
            piece[key] = t[lo:hi]
        out[name] = piece
    return out


def _qblock_start(opt, segs: list[Seg], name: str) -> int:
    s = 0
    for (nm, _off, n, _shape), cls, _at in _offsets(opt, segs):
        if nm == name:
            return s
        if cls == "elem8":
            s += _blocks(n, opt.block_size)
    raise KeyError(name)


def cut(opt, parts: list[tuple[int, int, dict[str, torch.Tensor]]], a: int, b: int) -> dict[str, torch.Tensor]:
    """Elements ``[a, b)`` of one tensor from ``parts`` (``(first, end, pieces)`` of the old layout's
    pieces that overlap it, in element order and contiguous)."""
    kinds = KINDS[type(opt).__name__]
    parts = sorted(parts, key=lambda p: p[0])
    base = parts[0][0]
    if base > a or parts[-1][1] < b or any(p[1] != q[0] for p, q in zip(parts, parts[1:])):
        raise CheckpointError(f"the saved pieces [{base}, {parts[-1][1]}) do not cover elements [{a}, {b})")
    bs = getattr(opt, "block_size", 1)
    out = {}
    for key in parts[0][2]:
        kind = kinds[key]
        if kind == "step":
            out[key] = torch.stack([p[2][key] for p in parts]).max().reshape(1)
            continue
        whole = torch.cat([p[2][key] for p in parts]) if len(parts) > 1 else parts[0][2][key]
        if kind == "qblock":
            out[key] = whole[(a - base) // bs:_blocks(b - base, bs)]
        else:
            out[key] = whole[a - base:b - base]
    return out


def join(opt, template: dict[str, torch.Tensor], segs: list[Seg], pieces: dict[str, dict[str, torch.Tensor]]
         ) -> dict[str, torch.Tensor]:
    """The flat state of the layout ``segs`` (shapes and dtypes of ``template``, what the optimizer holds
    for the block) from one piece per segment; padding zero (what a fresh shard holds)."""
    kinds = KINDS[type(opt).__name__]
    state = {k: torch.zeros_like(v) for k, v in template.items()}
    for (name, off, _n, _shape), _cls, at in _offsets(opt, segs):
        piece = pieces[name]
        for key, kind in kinds.items():
            if key not in piece:
                continue
            src = piece[key]
            if kind == "step":
                state[key].fill_(int(src.reshape(-1)[0]))
                continue
            if kind == "elem":
                lo = off
            elif kind == "qblock":
                lo = _qblock_start(opt, segs, name)
            else:
                lo = at
            dst = state[key].reshape(-1)[lo:lo + src.numel()]
            if dst.numel() != src.numel():
                raise CheckpointError(f"state {key} of {name}: {src.numel()} saved elements do not fit the layout")
            dst.copy_(src.to(dst.dtype))
    return state
