"""Block-wise 4-bit codes for Adam moments, two to a byte: ``Hybrid8bitAdamW(moment_bits=4)``.

The same construction as ``quant.py``'s 8-bit codes, with fewer bits: a code is the top bits of a
value's fp32 representation after scaling by a per-block absmax, so encoding is "scale, add half an
ulp, shift, clamp" and decoding is "shift, scale".  Both codes are non-linear (tiny floating-point
formats), so a block's small moments keep a few significant levels instead of the one or two a linear
absmax code would leave them.

- **signed** (first moment m): sign + 2 exponent bits + 1 mantissa bit.  The 8 magnitudes are
  {0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3, 1} of the block absmax (3.6 binades, a relative rounding error
  <= 1/5 above 1/6); code 0 is exactly zero, as in the 8-bit code.
- **unsigned** (sqrt of the second moment): 2 exponent + 2 mantissa bits, no sign.  The 15 values
  used are {1, 2, .., 8, 10, 12, .., 16, 20, 24, 28} / 28 of the block absmax (4.8 binades of sqrt(v),
  9.6 of v; relative error <= 1/8 on sqrt(v) above 1/7 of the absmax).  Code 0 is never written: an
  underflow is clamped to 1/28, so the denominator is only ever overestimated (a smaller step).

Why these splits of the 4 bits: m changes sign and its useful range within a block is narrow (the
update divides it by sqrt(v)), so its bits go to precision; sqrt(v) needs range more than precision,
and the square root already halves v's range.  A smaller quantization block than the 8-bit codes'
(``Hybrid8bitAdamW`` takes 128 elements for 4-bit moments, 2048 for 8-bit) keeps an outlier's reach
short, which matters more with 7 magnitudes than with 127 (the 4-bit-optimizer literature finds the
same for the first moment).

Packing: element ``2k`` of a run of codes is the low nibble of byte ``k``, element ``2k + 1`` the high
one.  A tensor's codes start at an even element (``Hybrid8bitAdamW.setup`` pads each tensor to an even
count), so no byte is shared by two tensors or by two work items.

Layout in fp32 bits: signed magnitudes at ``code << 22`` (sign bit ``0x8`` to bit 31), unsigned codes
at ``code << 21``; the top codes (``SIGNED_TOP``, ``UNSIGNED_TOP``) are ~2^-124 and ~2^-123, and
``quant.decode_ratio`` switches to the two-multiplication decode where ``absmax / top`` overflows (an
absmax above ~12).
"""

from __future__ import annotations

import torch

SIGNED_SHIFT, UNSIGNED_SHIFT = 22, 21
SIGNED_MAX, UNSIGNED_MAX = 7, 15
#: the fp32 values of the largest codes (7 with the sign bit clear, 15)
SIGNED_TOP = float(torch.tensor([SIGNED_MAX << SIGNED_SHIFT], dtype=torch.int32).view(torch.float32))
UNSIGNED_TOP = float(torch.tensor([UNSIGNED_MAX << UNSIGNED_SHIFT], dtype=torch.int32).view(torch.float32))


def packed_bytes(n: int) -> int:
    """Bytes holding ``n`` 4-bit codes."""
    return (n + 1) // 2


def unpack(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` codes (int32, flat) of ``packed`` (uint8, ``packed_bytes(n)`` of them); ``out``: an optional
    int32 buffer of at least ``2 * packed_bytes(n)`` elements."""
    nb = packed.numel()
    both = out[: 2 * nb].view(nb, 2) if out is not None else torch.empty(nb, 2, dtype=torch.int32,
                                                                           device=packed.device)
    both[:, 0].copy_(packed)
    both[:, 1].copy_(both[:, 0])
    both[:, 0].bitwise_and_(15)
    both[:, 1].bitwise_right_shift_(4)
    return both.view(-1)[:n]


def pack_(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Write int32 ``codes`` (flat, each in [0, 16), destroyed) into ``out`` (uint8, ``packed_bytes(n)``)."""
    n = codes.numel()
    full = n // 2 * 2
    pairs = codes[:full].view(-1, 2)
    pairs[:, 1].bitwise_left_shift_(4)
    pairs[:, 1].bitwise_or_(pairs[:, 0])
    out[: full // 2].copy_(pairs[:, 1])
    if n > full:
        out[full // 2].copy_(codes[full])


def encode_signed(x: torch.Tensor, enc: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Signed 4-bit codes (int32, in place of ``x``'s bits: ``x`` is destroyed) of ``x`` ([rows, B] fp32);
    ``enc`` the [rows, 1] ``quant.encode_factor`` with ``SIGNED_TOP``; ``tmp`` optional int32 scratch."""
    x.mul_(enc)
    xi = x.view(torch.int32)
    sign = torch.bitwise_right_shift(xi, 28, out=tmp) if tmp is not None else xi.bitwise_right_shift(28)
    sign.bitwise_and_(8)
    xi.bitwise_and_(0x7FFFFFFF)
    xi.add_(1 << (SIGNED_SHIFT - 1))  # round to nearest (ties away from zero)
    xi.bitwise_right_shift_(SIGNED_SHIFT)
    xi.clamp_max_(SIGNED_MAX)
    xi.bitwise_or_(sign)
    return xi


def decode_signed(codes: torch.Tensor, factor: torch.Tensor, pre: float = 1.0,
                  tmp: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of signed codes ``codes`` (int32 [rows, B], overwritten and returned as fp32) times the
    per-block ``factor`` [rows, 1] (and the global ``pre``)."""
    sign = torch.bitwise_and(codes, 8, out=tmp) if tmp is not None else codes.bitwise_and(8)
    codes.bitwise_xor_(sign)
    sign.bitwise_left_shift_(28)
    codes.bitwise_left_shift_(SIGNED_SHIFT)
    codes.bitwise_or_(sign)
    x = codes.view(torch.float32)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)


def encode_unsigned(x: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes (int32, in place of non-negative ``x``'s bits) of ``x`` ([rows, B] fp32)."""
    x.mul_(enc)
    xi = x.view(torch.int32)
    xi.add_(1 << (UNSIGNED_SHIFT - 1))
    xi.bitwise_right_shift_(UNSIGNED_SHIFT)
    return xi.clamp_(1, UNSIGNED_MAX)


def decode_unsigned(codes: torch.Tensor, factor: torch.Tensor, pre: float = 1.0) -> torch.Tensor:
    """fp32 values of unsigned codes ``codes`` (int32 [rows, B], overwritten and returned as fp32)."""
    codes.bitwise_left_shift_(UNSIGNED_SHIFT)
    x = codes.view(torch.float32)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)
