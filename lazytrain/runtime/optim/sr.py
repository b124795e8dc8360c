"""Stochastic rounding of an fp32 master to bf16, with counter-based random bits: ``Hybrid8bitAdamW``'s
``stochastic_rounding`` master (2 bytes a parameter instead of 4).

Why stochastic: an update smaller than half a bf16 ulp (1/256 of the weight, so any lr * step below ~0.4%
of it) is lost every time when rounded to nearest, and a bf16-only master stops learning; rounded up with
probability equal to the dropped fraction, the expected stored value is the fp32 result exactly, so small
updates add up on average.  Adding 16 uniform random bits to the fp32 bits and truncating the low half
does exactly that (the fp32 bits are linear in the value between two neighbouring bf16 values, sign and
magnitude alike).

Why counter-based: the random bits of element ``i`` at an update are a hash of (seed, block, step, i)
(``sr_key`` folds the first three into one 32-bit key, ``sr_bits`` mixes in ``i``), so a run, a resumed
run and any thread split give the same bits, no RNG state is kept or checkpointed, and the C kernel
(``ckernel.sr_bits``) and this torch path agree bit for bit.  The element mix is the "lowbias32" integer
finaliser, a bijection of uint32 with full avalanche; its high 16 bits are used.
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sr_key(seed: int, block: int, step: int) -> int:
    """The 32-bit key of block ``block``'s update number ``step`` under ``seed`` (a uint32 as a Python int)."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ block) ^ step) >> 32


def sr_bits(idx: torch.Tensor, key: int) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 2^16)) of the elements at block indices ``idx`` (int64) under ``key``:
    ``ckernel``'s ``sr_bits``, in int64 arithmetic masked to 32 bits (no reliance on int32 overflow)."""
    x = idx.mul(0x9E3779B9).bitwise_and_(_M32).bitwise_xor_(key)
    x.bitwise_xor_(x >> 16)
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x846CA68B).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16)
    return x.bitwise_right_shift_(16)


def round_sr_(p: torch.Tensor, hi: torch.Tensor, idx0: int, key: int) -> None:
    """Write fp32 ``p`` (flat, the elements ``idx0 ..`` of a block) rounded stochastically to bf16 into ``hi``
    (their int16 view of the bf16 load buffer)."""
    idx = torch.arange(idx0, idx0 + p.numel(), dtype=torch.int64, device=p.device)
    bits = p.reshape(-1).view(torch.int32).to(torch.int64).bitwise_and_(_M32)
    bits.add_(sr_bits(idx, key)).bitwise_right_shift_(16)
    hi.reshape(-1).copy_(bits.to(torch.int32).to(torch.int16))   # the low 16 bits: bf16's, sign included
