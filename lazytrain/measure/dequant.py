"""Time a quantized frozen base's dequantization on the device: ``dequant_gbps`` (NF4) and ``dequant8_gbps`` (int8).

The segment is a 7B (Llama-2) layer's frozen parameters in a block's order (7 matrices, 2 norms: 202 M values,
404 MB of bf16 out), as ``runtime/quantized.py`` lays it out, its sections in one device byte buffer as a load
leaves them; the rate is the bytes ``dequantize_into`` writes a second (parameter dtype, quantized parameters and
the raw norms' copy alike).  Dequantizing does the same work whatever the values, so the sections are filled with
random codes and valid scales rather than quantized (NF4's quantization takes minutes on a CPU).  On the CPU, and
with ``quick``, the layer is scaled down (``scale``: its matrices' rows divided).
"""

from __future__ import annotations

import torch

from ..runtime.quantized import QuantizedSegment, pieces_of
from .timing import median_seconds

__all__ = ["LAYER_7B", "synthetic_segment", "dequant_seconds", "dequant_rates"]

#: a 7B (Llama-2) decoder layer's parameters, in a block's order
LAYER_7B = (("self_attn.q_proj.weight", (4096, 4096)), ("self_attn.k_proj.weight", (4096, 4096)),
            ("self_attn.v_proj.weight", (4096, 4096)), ("self_attn.o_proj.weight", (4096, 4096)),
            ("mlp.gate_proj.weight", (11008, 4096)), ("mlp.up_proj.weight", (11008, 4096)),
            ("mlp.down_proj.weight", (4096, 11008)), ("input_layernorm.weight", (4096,)),
            ("post_attention_layernorm.weight", (4096,)))


def layer_params(scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """``LAYER_7B`` with each matrix's rows divided by ``scale``."""
    return [(n, (s[0] // scale, *s[1:]) if len(s) == 2 else s) for n, s in LAYER_7B]


def synthetic_segment(bits: int, params, dtype: torch.dtype = torch.bfloat16, block_size: int = 64,
                      seed: int = 0) -> QuantizedSegment:
    """A segment of these ``(name, shape)`` parameters with random codes and scales of weights' size."""
    pieces = pieces_of(params)
    probe = QuantizedSegment(pieces=pieces, bits=bits, block_size=block_size, dtype=dtype, tensors={})
    header = probe.header()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, _, nbytes in probe.sections():
        dt = probe.section_dtype(name)
        n = nbytes // dt.itemsize
        if dt in (torch.uint8, torch.int8):
            t = torch.randint(-127 if dt == torch.int8 else 0, 128 if dt == torch.int8 else 256, (n,), generator=g,
                              dtype=dt)
        elif name == "factors":
            t = torch.full((n,), 128 / 0.01, dtype=dt)
        elif name == "scales":
            t = torch.full((n,), 0.05 / 127, dtype=dt)
        elif name == "means":
            t = torch.full((n,), 0.05, dtype=dt)
        elif name == "lut":
            t = torch.linspace(-1, 1, 16, dtype=dt)
        else:
            t = torch.ones(n, dtype=dt)
        tensors[name] = t
    return QuantizedSegment.from_parts(header, tensors)


def dequant_seconds(seg: QuantizedSegment, device: torch.device, repeats: int) -> float:
    """Median seconds of ``dequantize_into`` on ``device``, its sections in one device byte buffer."""
    buffer = torch.empty(seg.nbytes, dtype=torch.uint8, device=device)
    views = seg.views(buffer)
    for name, view in views.items():
        view.copy_(seg.host_tensors()[name])
    dst = torch.empty(seg.numel, dtype=seg.dtype, device=device)
    return median_seconds(lambda: seg.dequantize_into(dst, views), repeats, device)


def dequant_rates(device: torch.device, quick: bool = False, repeats: int = 5) -> dict[str, float]:
    """``dequant_gbps`` and ``dequant8_gbps`` measured on ``device`` (module docstring)."""
    scale = 1 if device.type == "cuda" and not quick else (4 if device.type == "cuda" else 32)
    params = layer_params(scale)
    out = {}
    for bits, key in ((4, "dequant_gbps"), (8, "dequant8_gbps")):
        seg = synthetic_segment(bits, params)
        out[key] = seg.numel * seg.dtype.itemsize / dequant_seconds(seg, device, repeats) / 1e9
    return out
