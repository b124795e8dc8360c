"""Block-wise 4-bit codes for Adam moments, two to a byte: ``Hybrid8bitAdamW(moment_bits=4)``.

Like ``quant.py``'s 8-bit codes, a code is a tiny floating-point format relative to a per-block absmax, read
and written with integer bit tricks (no table, no search).  Unlike them, the codes sit in the fp32 bits of
``1 + r`` (``r`` the value scaled so the block absmax is the top value) instead of at tiny fp32 magnitudes:
the 8-bit codes' smallest values are fp32 subnormals, rare there, but a 4-bit code's smallest nonzero value
is a common one, and subnormal arithmetic runs ~50x slower on x86 (measured: 0.03 G params/s against ~1).
Decoding is ``float(bits + ONE) - 1``, encoding ``bits(r + 1) - ONE``, rounded to nearest and clamped; every
intermediate is a normal float between 1 and 16.

- **signed** (first moment m): sign + 2 exponent bits + 1 mantissa bit of ``1 + r``.  The 8 magnitudes are
  {0, 1/2, 1, 2, 3, 5, 7, 11} / 11 of the block absmax (4.5 binades; relative rounding error <= 1/5 from
  1/11 up); code 0 is exactly zero (a parameter with no gradient keeps m = 0), code 8 is -0.
- **unsigned** (sqrt of the second moment): 2 exponent + 2 mantissa bits, no sign.  The 15 values used are
  {1/4, 1/2, 3/4, 1, 3/2, 2, 5/2, 3, 4, 5, 6, 7, 9, 11, 13} / 13 of the block absmax (5.7 binades of sqrt(v),
  11.4 of v).  Code 0 is never written: an underflow is clamped to 1/52, so the denominator is only ever
  overestimated (a smaller step), never collapses to eps.

Why these splits of the 4 bits: m changes sign and the update divides it by sqrt(v), so its bits go to the
sign and precision; sqrt(v) needs range, and the square root already halves v's.  A smaller quantization
block than the 8-bit codes' (``Hybrid8bitAdamW`` takes 128 elements for 4-bit moments, 2048 for 8-bit) keeps
an outlier's reach short, which matters more with 7 magnitudes than with 127 (the 4-bit-optimizer literature
finds the same for the first moment).

Packing: element ``2k`` of a run of codes is the low nibble of byte ``k``, element ``2k + 1`` the high one.
A tensor's codes start at an even element (``Hybrid8bitAdamW.setup`` pads each tensor to an even count), so
no byte is shared by two tensors or by two work items.
"""

from __future__ import annotations

import torch

SIGNED_SHIFT, UNSIGNED_SHIFT = 22, 21
SIGNED_MAX, UNSIGNED_MAX = 7, 15
#: the fp32 bits of 1.0: a code's bits are added to them (decode) or taken off (encode)
ONE = 0x3F800000
#: the largest codes' values (``r`` of 7 and of 15): a block's absmax is scaled onto them
SIGNED_TOP, UNSIGNED_TOP = 11.0, 13.0


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
    x.add_(1.0)
    xi.sub_(ONE - (1 << (SIGNED_SHIFT - 1)))  # round to nearest (ties away from zero)
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
    codes.add_(ONE)
    x = codes.view(torch.float32)
    x.sub_(1.0)
    codes.bitwise_or_(sign)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)


def encode_unsigned(x: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes (int32, in place of non-negative ``x``'s bits) of ``x`` ([rows, B] fp32)."""
    x.mul_(enc)
    x.add_(1.0)
    xi = x.view(torch.int32)
    xi.sub_(ONE - (1 << (UNSIGNED_SHIFT - 1)))
    xi.bitwise_right_shift_(UNSIGNED_SHIFT)
    return xi.clamp_(1, UNSIGNED_MAX)


def decode_unsigned(codes: torch.Tensor, factor: torch.Tensor, pre: float = 1.0) -> torch.Tensor:
    """fp32 values of unsigned codes ``codes`` (int32 [rows, B], overwritten and returned as fp32)."""
    codes.bitwise_left_shift_(UNSIGNED_SHIFT)
    codes.add_(ONE)
    x = codes.view(torch.float32)
    x.sub_(1.0)
    if pre != 1.0:
        x.mul_(pre)
    return x.mul_(factor)
