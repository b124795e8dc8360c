"""Host optimizer throughput (G params/s) on one transformer-layer-sized block.

    python benchmarks/optim_rate.py [--numel 77100000] [--threads N] [--steps 3] [--sr] [--bits4]

A block of ``--numel`` parameters (default: one Qwen2.5-3B decoder layer, 77.1M) with a bf16 load
buffer and bf16 gradients, as the runtime hands them over.  Reports the median step time of
``--steps`` steps after one warm-up, for TorchAdamW (fp32 master and moments) and
Hybrid8bitAdamW, and each one's host bytes/param.

Measured (77.1M-param block, bf16 buffers, median of 10 steps unless noted), G params/s:

| machine | threads | TorchAdamW (fused) | Hybrid8bitAdamW C kernel | 8-bit torch-ops fallback |
| --- | --- | --- | --- | --- |
| lent H200 host, 16 cores, idle | 16 | 2.42 | 5.98 | 0.08 |
| same | 8 | 1.62 | 4.7 | |
| same | 1 | 0.43 | 0.82 | |
| dev box, 2 cores, shared (load ~2-4) | 2 | 0.13 | 0.88 | 0.01-0.03 |
| same | 1 | 0.43 | 0.66 | |
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lazytrain.runtime.optim import Hybrid8bitAdamW, TorchAdamW


def rate(opt, numel: int, steps: int) -> float:
    init = torch.randn(numel) * 0.02
    load = torch.empty(numel, dtype=torch.bfloat16)
    big = numel - 2 * 2048
    segs = [("w", 0, big, (big,)), ("norm", big, 2048, (2048,)), ("bias", big + 2048, 2048, (2048,))]
    opt.setup(0, init, load, segs)
    del init
    grad = (torch.randn(numel) * 1e-3).to(torch.bfloat16)
    opt.step(0, grad, 0.5)  # warm-up (first touch of the state)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step(0, grad, 0.5)
        times.append(time.perf_counter() - t0)
    return numel / statistics.median(times) / 1e9, opt.host_bytes_per_param


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=77_100_000)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="Hybrid8bitAdamW chunk_numel")
    ap.add_argument("--only", choices=["torch", "8bit"], default=None)
    ap.add_argument("--no-kernel", action="store_true", help="Hybrid8bitAdamW: the torch-ops path, not the C kernel")
    ap.add_argument("--sr", action="store_true", help="Hybrid8bitAdamW with the stochastic-rounding bf16 master too "
                                                      "(hybrid8bit-sr), after the exact one")
    ap.add_argument("--bits4", action="store_true", help="Hybrid8bitAdamW with 4-bit moments too (hybrid4bit, and "
                                                         "hybrid4bit-sr with --sr), after the 8-bit ones")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"block of {a.numel / 1e6:.1f}M params, bf16 load buffer and grads, {a.threads} threads")
    if a.only in (None, "torch"):
        r, b = rate(TorchAdamW(lr=1e-4, weight_decay=0.1), a.numel, a.steps)
        print(f"TorchAdamW       {r:6.3f} G params/s   {b:.3f} B/param")
    if a.only in (None, "8bit"):
        kw = {"chunk_numel": a.chunk} if a.chunk else {}
        kw["kernel"] = False if a.no_kernel else None
        path = "torch ops" if a.no_kernel else "C kernel"
        for bits in (8, 4) if a.bits4 else (8,):
            for sr in (False, True) if a.sr else (False,):
                opt = Hybrid8bitAdamW(lr=1e-4, weight_decay=0.1, num_threads=a.threads, stochastic_rounding=sr,
                                      moment_bits=bits, **kw)
                r, b = rate(opt, a.numel, a.steps)
                name = f"hybrid{bits}bit{'-sr' if sr else ''}"
                print(f"{name:15s}  {r:6.3f} G params/s   {b:.3f} B/param   ({path})")


if __name__ == "__main__":
    main()
