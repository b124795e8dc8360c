"""What a quantized frozen base costs a block: the bytes its frozen parameters take over PCIe, and the seconds the
GPU spends dequantizing them before the block runs.

At ``bits`` 16 the frozen parameters load as they are (their dtype's bytes, nothing to dequantize).  At 8 or 4 they
load packed (``lazytrain.util.quant_format``: the runtime's own layout, so these are the runtime's bytes) and the
GPU writes them back out in their dtype at ``HardwareProfile.dequant8_gbps`` / ``dequant_gbps`` (GB/s of output);
the parameters kept unquantized (norms, biases, embeddings: ``quantized_param``) load raw and cost no dequantization.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.graph import ParamSpec
from ..util.quant_format import check_bits, packed_nbytes, quantized_param
from .hardware import HardwareProfile

__all__ = ["FrozenCost", "frozen_cost"]


@dataclass(frozen=True, slots=True)
class FrozenCost:
    """A block's frozen parameters at some width: ``load_bytes`` over PCIe, ``dequant_seconds`` on the GPU, and the
    bytes they take in their dtype once dequantized (``param_bytes``, what the block's load buffer holds on the GPU)."""
    load_bytes: int
    dequant_seconds: float
    param_bytes: int


def frozen_cost(params: Iterable[ParamSpec], bits: int, dtype_bytes: int, hw: HardwareProfile,
                block_size: int = 64) -> FrozenCost:
    """The cost of loading a block's frozen ``params`` (in the segment's order) held at ``bits`` (16, 8 or 4)."""
    check_bits(bits, block_size)
    quantized, raw = [], 0
    for p in params:
        if quantized_param(p.name, p.shape):
            quantized.append(p.numel)
        else:
            raw += p.numel
    param_bytes = (sum(quantized) + raw) * dtype_bytes
    if bits == 16:
        return FrozenCost(load_bytes=param_bytes, dequant_seconds=0.0, param_bytes=param_bytes)
    rate = hw.dequant_gbps if bits == 4 else hw.dequant8_gbps
    return FrozenCost(load_bytes=packed_nbytes(quantized, raw, bits, block_size, dtype_bytes),
                      dequant_seconds=sum(quantized) * dtype_bytes / (rate * 1e9), param_bytes=param_bytes)
