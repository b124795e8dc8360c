"""A quantized frozen base on the device: dequantizing a 7B layer (NF4 and int8) and moving its packed bytes over PCIe,
against the same layer's bf16 bytes.

    PYTHONPATH=. python benchmarks/quantized_base.py [--scale 1] [--repeats 10] [--real] [--out DIR]

The segment is a 7B (Llama-2) layer's frozen parameters (``lazytrain.measure.dequant.LAYER_7B``: 202 M values,
404 MB in bf16), laid out by ``runtime/quantized.py``; ``--scale N`` divides its matrices' rows (the CPU default is
32).  For each width it times, as medians of ``--repeats`` after a warm-up: the pinned host -> device copy of the
packed buffer (``h2d_s``), ``dequantize_into`` on the device (``dequant_s``, and ``dequant_gbps``: bf16 bytes
written a second), and both one after the other (``load_s``), beside the bf16 copy alone.  ``--real`` quantizes
normal weights through torchao (on the device) and records the relative error too; without it the codes are
synthetic (dequantizing does the same work whatever the values).  Prints a table and writes ``results.json`` under
``--out``; CUDA events on a GPU, wall time on the CPU (where "pinned" and the copy are a memcpy).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from lazytrain.measure.dequant import layer_params, synthetic_segment
from lazytrain.measure.timing import median_seconds as _median
from lazytrain.runtime.quantized import QuantizedSegment, pieces_of


def _segment(bits: int, params, real: bool, device: torch.device) -> tuple[QuantizedSegment, float | None]:
    """The layer's segment at ``bits``, and its relative error when quantized from real weights."""
    if not real:
        return synthetic_segment(bits, params), None
    n = sum(torch.Size(s).numel() for _, s in params)
    flat = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    seg = QuantizedSegment.quantize(flat, bits, pieces=pieces_of(params), device=device)
    out = seg.dequantize(device).cpu().float()
    return seg, ((out - flat.float()).norm() / flat.float().norm()).item()


def row(bits: int, params, repeats: int, real: bool, device: torch.device) -> dict:
    pin = device.type == "cuda"
    if bits == 16:
        n = sum(torch.Size(s).numel() for _, s in params)
        host = torch.empty(n * 2, dtype=torch.uint8, pin_memory=pin)
        dev = torch.empty_like(host, device=device)
        h2d = _median(lambda: dev.copy_(host, non_blocking=True), repeats, device)
        return {"bits": 16, "values": n, "bytes": n * 2, "h2d_s": h2d, "dequant_s": 0.0, "load_s": h2d,
                "h2d_gbps": n * 2 / h2d / 1e9, "dequant_gbps": None, "rel_error": 0.0}
    seg, error = _segment(bits, params, real, device)
    host = torch.empty(seg.nbytes, dtype=torch.uint8, pin_memory=pin)
    seg.copy_into(host)
    dev = torch.empty_like(host, device=device)
    views = seg.views(dev)
    dst = torch.empty(seg.numel, dtype=seg.dtype, device=device)
    h2d = _median(lambda: dev.copy_(host, non_blocking=True), repeats, device)
    dq = _median(lambda: seg.dequantize_into(dst, views), repeats, device)

    def load() -> None:
        dev.copy_(host, non_blocking=True)
        seg.dequantize_into(dst, views)
    both = _median(load, repeats, device)
    out_bytes = seg.numel * seg.dtype.itemsize
    return {"bits": bits, "values": seg.numel, "bytes": seg.nbytes, "h2d_s": h2d, "dequant_s": dq, "load_s": both,
            "h2d_gbps": seg.nbytes / h2d / 1e9, "dequant_gbps": out_bytes / dq / 1e9, "rel_error": error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--scale", type=int, default=None, help="divide the layer's matrix rows (default 1 GPU, 32 CPU)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--real", action="store_true", help="quantize normal weights through torchao (error too)")
    ap.add_argument("--out", default=None, help="folder for results.json")
    a = ap.parse_args()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scale = a.scale or (1 if device.type == "cuda" else 32)
    params = layer_params(scale)
    rows = [row(bits, params, a.repeats, a.real, device) for bits in (16, 8, 4)]
    print(f"7B layer / {scale}: {rows[0]['values'] / 1e6:.1f} M values on {device}")
    print("bits | MB moved | h2d ms | h2d GB/s | dequant ms | dequant GB/s (bf16 out) | load ms | vs bf16 | rel error")
    for r in rows:
        print(f"{r['bits']:4d} | {r['bytes'] / 1e6:8.1f} | {r['h2d_s'] * 1e3:6.2f} | {r['h2d_gbps']:8.1f} | "
              f"{r['dequant_s'] * 1e3:10.2f} | {r['dequant_gbps'] or 0:23.1f} | {r['load_s'] * 1e3:7.2f} | "
              f"{r['load_s'] / rows[0]['load_s']:7.2f} | {r['rel_error'] if r['rel_error'] is not None else '-'}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__, "scale": scale, "repeats": a.repeats, "real": a.real}
        (out / "results.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
