"""Fused attention kernels at the 3B and 7B attention shapes, and a compiled layer-sized forward beside host work.

    python benchmarks/sdpa_kernels.py            (writes sdpa_kernels.json to $OUT or here)

1. ``scaled_dot_product_attention`` forward and forward + backward (bf16, seq 1024, head dim 128, causal,
   micro-batch 32) with each of the flash, cuDNN and memory-efficient kernels, grouped-query K/V passed as they
   are (``enable_gqa``) or repeated; TFLOP/s counted as the kernel computes (causal half, backward 2.5x).
2. A ``torch.compile``d qwen2.5-3b-sized MLP timed alone and while other threads hold the GIL (pure Python),
   copy host memory (``copy_`` of 512 MiB), or copy pinned host memory to the GPU on another stream: which host
   activity slows the thread that issues the GPU's work.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = (("qwen2.5-3b", 16, 2), ("qwen2.5-7b", 28, 4))
KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def timed(fn, iters: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def one_kernel(q, k, v, kernel, gqa: bool) -> dict:
    """Forward and forward + backward of one kernel on (q, k, v); K/V repeated to q's heads unless ``gqa``."""
    rep = q.shape[1] // k.shape[1]

    def run():
        kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
    grad = torch.randn_like(run())
    fwd = timed(run)
    both = timed(lambda: torch.autograd.grad(run(), (q, k, v), grad))
    b, h, s, d = q.shape
    flops = 4 * b * h * s * s * d / 2
    return {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3, "fwd_tflops": flops / fwd / 1e12,
            "fwd_bwd_tflops": 3.5 * flops / both / 1e12}


def attention(out: dict, micro_batch: int = 32, seq: int = 1024, head_dim: int = 128) -> None:
    for name, heads, kv in SHAPES:
        q, k, v = (torch.randn(micro_batch, n, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (heads, kv, kv))
        for kernel in KERNELS:
            for gqa in (True, False):
                key = f"{name}_{kernel.name}_gqa{int(gqa)}"
                try:
                    out[key] = one_kernel(q, k, v, kernel, gqa)
                except RuntimeError as e:
                    out[key] = {"error": str(e)[:200]}
                print(key, out[key], flush=True)


def contention(out: dict) -> None:
    h, inter, tokens = 2048, 11008, 32 * 1024
    w1 = torch.randn(2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(h, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)

    @torch.compile
    def mlp(x):
        a, b = (x @ w1.t()).chunk(2, -1)
        return x + (F.silu(a) * b) @ w2.t()

    stop = threading.Event()
    big, big2 = torch.empty(512 * 2**20, dtype=torch.uint8), torch.empty(512 * 2**20, dtype=torch.uint8)
    pinned = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    on_gpu = torch.empty(pinned.shape, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def hold_gil():
        while not stop.is_set():
            sum(i * i for i in range(10000))

    def copy_host():
        while not stop.is_set():
            big2.copy_(big)

    def copy_h2d():
        with torch.cuda.stream(stream):
            while not stop.is_set():
                on_gpu.copy_(pinned, non_blocking=True)
                stream.synchronize()

    for label, work, n in (("alone", None, 0), ("gil_hog", hold_gil, 2), ("mem_hog", copy_host, 1),
                           ("h2d_hog", copy_h2d, 1)):
        stop.clear()
        threads = [threading.Thread(target=work) for _ in range(n)]
        for th in threads:
            th.start()
        time.sleep(0.2)
        out[f"mlp_{label}_ms"] = timed(lambda: mlp(x), 20) * 1e3
        stop.set()
        for th in threads:
            th.join()
        print(f"mlp {label}: {out[f'mlp_{label}_ms']:.3f} ms per call", flush=True)


def main() -> None:
    out: dict = {}
    attention(out)
    contention(out)
    with open(os.path.join(os.environ.get("OUT", "."), "sdpa_kernels.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
