"""Block-wise 8-bit codes for Adam moments, encoded and decoded with integer bit tricks.

Both codes are tiny floating-point formats *relative to a per-block absmax scale*: a value's code
is the top bits of its fp32 representation after scaling, so encoding is "scale, add half an ulp,
shift" and decoding is "shift, scale" -- a handful of cheap vectorized integer ops per element, no
table look-up or search (a search over a 256-entry dynamic-tree code costs ~8 compares per element).
Like the dynamic codes of the 8-bit-optimizer literature, they are non-linear: the relative error is
the same at every magnitude, so the many small moments of a block are not flushed to zero by one
large one (a linear absmax code keeps ~1 significant bit for a value 64x below the block max).

- **signed** (first moment m): sign + 4 exponent bits + 3 mantissa bits.  16 binades below the block
  absmax (down to ~1.5e-5 of it) with a relative rounding error <= 1/16; code 0 is exactly zero, so a
  parameter with no gradient keeps m = 0 and does not move.
- **unsigned** (sqrt of the second moment): 4 exponent + 4 mantissa bits, no sign wasted; relative
  error <= 1/32 on sqrt(v) (<= ~6.3% on v) over 16 binades of sqrt(v) = 32 binades of v.  Encoding
  never gives code 0 for a positive value: an underflow is clamped to the smallest code, so the
  denominator sqrt(v)+eps can only be overestimated (a smaller step), never collapse to eps.

Layout: the code's bits sit where fp32 keeps its low exponent bits and top mantissa bits
(``code << 20`` for signed magnitudes, ``code << 19`` for unsigned), i.e. codes live at tiny fp32
magnitudes (top code = ``SIGNED_TOP`` / ``UNSIGNED_TOP`` ~ 2^-111).  The per-block factors therefore
carry a 2^112; a block whose absmax is so large that the factor overflows fp32 (absmax > ~6e4)
is decoded in two multiplications instead (``decode_factor`` handles it).
"""

from __future__ import annotations

import math

import torch

SIGNED_SHIFT, UNSIGNED_SHIFT = 20, 19
#: the fp32 values of the largest codes (127 with the sign bit clear, 255)
SIGNED_TOP = float(torch.tensor([127 << SIGNED_SHIFT], dtype=torch.int32).view(torch.float32))
UNSIGNED_TOP = float(torch.tensor([255 << UNSIGNED_SHIFT], dtype=torch.int32).view(torch.float32))
_TWO_112 = 2.0**112


def encode_factor(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """Per-block multiplier that maps the block absmax onto the top code (0 for an all-zero block)."""
    f = top / absmax
    return torch.where(absmax > 0, f, torch.zeros_like(f))


def decode_ratio(absmax: torch.Tensor | float, top: float, extra: float = 1.0) -> tuple[float, float]:
    """(ratio, pre) with ``value = code_float * pre * (absmax * ratio)``: ``pre`` is 1.0 unless the
    one-step factor ``absmax * extra / top`` overflows fp32 for some block.  ``absmax`` may be given
    as its maximum (a float)."""
    if isinstance(absmax, torch.Tensor):  # (an empty one: a block with no quantized tensor)
        amax = float(absmax.max()) if absmax.numel() else 0.0
    else:
        amax = float(absmax or 0.0)
    if math.isfinite(float(torch.tensor(amax, dtype=torch.float32) * torch.tensor(extra / top, dtype=torch.float32))):
        return extra / top, 1.0
    return extra / (top * _TWO_112), _TWO_112


def decode_factor(absmax: torch.Tensor, top: float, extra: float = 1.0) -> tuple[torch.Tensor, float]:
    """(per-block factor, global pre-factor) with ``value = code_float * pre * factor``."""
    ratio, pre = decode_ratio(absmax, top, extra)
    return absmax * ratio, pre


def encode_signed_(x: torch.Tensor, enc: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor | None = None) -> None:
    """Quantize ``x`` ([nblocks, B] fp32, destroyed) into ``out`` (uint8 [nblocks, B]); ``enc`` is
    the [nblocks, 1] ``encode_factor``; ``tmp`` an optional int32 scratch shaped like ``x``."""
    x.mul_(enc)
    xi = x.view(torch.int32)
    sign = torch.bitwise_right_shift(xi, 24, out=tmp) if tmp is not None else xi.bitwise_right_shift(24)
    sign.bitwise_and_(0x80)
    xi.bitwise_and_(0x7FFFFFFF)
    xi.add_(1 << (SIGNED_SHIFT - 1))  # round to nearest (ties away from zero)
    xi.bitwise_right_shift_(SIGNED_SHIFT)
    xi.clamp_max_(127)
    xi.bitwise_or_(sign)
    out.copy_(xi)


def decode_signed(
    q: torch.Tensor, factor: torch.Tensor, pre: float = 1.0, out: torch.Tensor | None = None, tmp=None
) -> torch.Tensor:
    """fp32 values of signed codes ``q`` (uint8 [nblocks, B]) times the per-block ``factor`` [nblocks, 1];
    ``out`` and ``tmp`` are optional int32 scratch tensors shaped like ``q`` (``out`` is returned as fp32)."""
    ci = out.copy_(q) if out is not None else q.to(torch.int32)
    sign = torch.bitwise_and(ci, 0x80, out=tmp) if tmp is not None else ci.bitwise_and(0x80)
    ci.bitwise_xor_(sign)
    sign.bitwise_left_shift_(24)
    ci.bitwise_left_shift_(SIGNED_SHIFT)
    ci.bitwise_or_(sign)
    x = ci.view(torch.float32)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)


def encode_unsigned_(x: torch.Tensor, enc: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize non-negative ``x`` ([nblocks, B] fp32, destroyed) into ``out`` (uint8)."""
    x.mul_(enc)
    xi = x.view(torch.int32)
    xi.add_(1 << (UNSIGNED_SHIFT - 1))
    xi.bitwise_right_shift_(UNSIGNED_SHIFT)
    xi.clamp_(1, 255)
    out.copy_(xi)


def decode_unsigned(q: torch.Tensor, factor: torch.Tensor, pre: float = 1.0, out: torch.Tensor | None = None):
    ci = out.copy_(q) if out is not None else q.to(torch.int32)
    ci.bitwise_left_shift_(UNSIGNED_SHIFT)
    x = ci.view(torch.float32)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)


def absmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| of a [nblocks, B] tensor in two vectorized reductions (no |x| temporary)."""
    return torch.maximum(x.amax(dim=1), x.amin(dim=1).neg_())
