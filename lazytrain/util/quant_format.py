"""The byte layout of a quantized frozen segment, as arithmetic on counts (no torch).

A block's frozen parameters are one flat segment on the host.  At ``bits`` 4 (NF4, QLoRA's format as torchao
implements it) or 8 (block-wise absmax int8) the segment is held as a few plain arrays, each a *section* of one
byte buffer, so that a pinned host buffer holds them and one copy moves them to the GPU:

- the quantized **stream**: the quantized parameters one after another, each padded with zeros to a whole
  quantization block (``block_size`` values share one scale, and no block spans two parameters); NF4 pads the
  stream's end to a whole chunk group (``block_size * SCALER_BLOCK``, torchao's requirement);
- NF4: ``codes`` (two 4-bit codes a byte), ``scalers`` (one int8 a block: the double-quantized absmax),
  ``factors`` (one a ``SCALER_BLOCK`` of scalers, in the parameter dtype), ``means`` (one a chunk, the
  scalers' mean), ``lut`` (torchao's 16 NF4 values in the parameter dtype); int8: ``codes`` (int8) and
  ``scales`` (float32, one a block);
- ``raw``: the parameters kept unquantized (norms, biases: QLoRA keeps them 16-bit), in the parameter dtype.

The stream is quantized in chunks of at most ``CHUNK`` values (each chunk one torchao NF4 tensor, with its own
scaler mean), so quantizing and dequantizing need no temporary larger than one chunk's.  Every section starts on
an ``ALIGN``-byte boundary, so it can be viewed as its dtype inside a byte buffer.

``lazytrain.runtime.quantized`` builds the arrays; ``lazytrain.compiler.quant_cost`` prices them.  Both read the
sizes from here, so the compiler's bytes are the runtime's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["quantized_param", "BITS", "SCALER_BLOCK", "CHUNK", "ALIGN", "sections", "packed_nbytes", "bytes_per_param",
           "stream_numel", "check_bits"]

#: the frozen base's widths: 16 (as the parameters are, nothing to do), 8 (int8) and 4 (NF4)
BITS = (16, 8, 4)
#: NF4's second-level block: this many block scalers share one quantization factor (QLoRA and torchao: 256)
SCALER_BLOCK = 256
#: values per quantization chunk (a multiple of ``64 * SCALER_BLOCK``): bounds the temporaries of quantizing
#: and of dequantizing to one chunk's, 16 Mi values (32 MiB at bf16), while a 7B layer is ~13 chunks
CHUNK = 1 << 24
#: every section starts on this many bytes (the widest element is 8 bytes; 16 keeps vector loads aligned)
ALIGN = 16


def quantized_param(name: str, shape: Sequence[int]) -> bool:
    """QLoRA's choice of what to quantize: a linear layer's weight matrix; never norms or biases (1-D), nor
    embeddings and the output head, which QLoRA keeps in 16 bits (a 7B layer's raw share: 8 Ki of 202 Mi values)."""
    return len(shape) == 2 and "embed" not in name and "lm_head" not in name


def check_bits(bits: int, block_size: int) -> None:
    """Raise ValueError unless ``bits`` is a supported width and ``block_size`` an even positive size."""
    if bits not in BITS:
        raise ValueError(f"base bits must be one of 16, 8 or 4, got {bits!r}")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 2 or CHUNK % (block_size * SCALER_BLOCK):
        raise ValueError(f"quantization block size must be an even power of two up to {CHUNK // SCALER_BLOCK}, "
                         f"got {block_size!r}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def stream_numel(quantized_numels: Sequence[int], bits: int, block_size: int) -> int:
    """Values in the quantized stream: each parameter padded to whole blocks, NF4's end to a whole group."""
    n = sum(_round_up(int(k), block_size) for k in quantized_numels)
    return _round_up(n, block_size * SCALER_BLOCK) if bits == 4 else n


def sections(quantized_numels: Sequence[int], raw_numel: int, bits: int, block_size: int,
             dtype_bytes: int) -> list[tuple[str, int, int]]:
    """``(name, byte offset, byte length)`` of each section of the packed buffer, in order (module docstring)."""
    check_bits(bits, block_size)
    if bits == 16:
        sizes = [("raw", (sum(quantized_numels) + raw_numel) * dtype_bytes)]
    else:
        n = stream_numel(quantized_numels, bits, block_size)
        blocks = n // block_size
        if bits == 4:
            sizes = [("codes", n // 2), ("scalers", blocks), ("factors", blocks // SCALER_BLOCK * dtype_bytes),
                     ("means", math.ceil(n / CHUNK) * dtype_bytes), ("lut", 16 * dtype_bytes)]
        else:
            sizes = [("codes", n), ("scales", blocks * 4)]
        sizes.append(("raw", raw_numel * dtype_bytes))
    out, offset = [], 0
    for name, nbytes in sizes:
        out.append((name, offset, nbytes))
        offset = _round_up(offset + nbytes, ALIGN)
    return out


def packed_nbytes(quantized_numels: Sequence[int], raw_numel: int, bits: int, block_size: int,
                  dtype_bytes: int) -> int:
    """Bytes of the packed buffer (what a pinned host buffer holds and a load moves over PCIe)."""
    name, offset, nbytes = sections(quantized_numels, raw_numel, bits, block_size, dtype_bytes)[-1]
    return _round_up(offset + nbytes, ALIGN)


def bytes_per_param(bits: int, block_size: int = 64, dtype_bytes: int = 2) -> float:
    """Bytes a quantized parameter takes in the limit of a large one (padding and the ``raw`` section aside):
    NF4 at block 64 ``0.5 + 1/64 + 2/16384`` = 0.5157 (bf16), int8 ``1 + 4/64`` = 1.0625, 16 bits ``dtype_bytes``."""
    check_bits(bits, block_size)
    if bits == 16:
        return float(dtype_bytes)
    if bits == 4:
        return 0.5 + 1 / block_size + dtype_bytes / (block_size * SCALER_BLOCK)
    return 1 + 4 / block_size
