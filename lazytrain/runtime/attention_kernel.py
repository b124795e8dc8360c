"""Which fused attention kernel a block's ``scaled_dot_product_attention`` runs on the GPU: cuDNN's first.

PyTorch's dispatcher tries flash attention before cuDNN's.  Measured on the H200 (torch 2.11, bf16, seq 1024, head
dim 128, causal, grouped-query K and V passed as they are; ``benchmarks/results/h200_2026-12-02/s8_micro.json``),
forward + backward of one layer's attention at micro-batch 32: qwen2.5-3b's shape (16 heads, 2 K/V heads) 1.41 ms
with cuDNN against 2.59 with flash, qwen2.5-7b's (28 / 4) 2.40 against 4.50; forward alone 0.29 / 0.52 and
0.50 / 0.89 ms (~480 TFLOP/s against ~265).  The cost model's Hopper attention rates (``hardware.HOPPER_ATTENTION``)
are cuDNN's.  A call cuDNN cannot run (a mask it does not take, a head dimension, a dtype) falls through to the
next kernel in the order, as torch's own order does.

``preferred(device)`` is the context every block program runs in (``Trainer``: the compile of the block
programs, whose graphs record the kernel chosen when they are traced, and each step, eager blocks' forwards,
recomputes and backwards).  ``LAZYTRAIN_ATTENTION=torch`` keeps torch's order (to compare, or where a cuDNN
version misbehaves); the order is torch's too on a GPU before Hopper (compute capability 9), where cuDNN's
attention was not measured.
"""

from __future__ import annotations

import contextlib
import os

import torch

#: the kernels in the order they are tried
ORDER = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def chosen(device: torch.device) -> str:
    """"cudnn" where ``preferred`` puts cuDNN's kernel first on ``device``, else "torch" (the dispatcher's order)."""
    if os.environ.get("LAZYTRAIN_ATTENTION", "cudnn") == "torch" or device.type != "cuda":
        return "torch"
    if not torch.backends.cuda.cudnn_sdp_enabled() or torch.cuda.get_device_capability(device) < (9, 0):
        return "torch"
    return "cudnn"


def preferred(device: torch.device):
    """A context in which attention on ``device`` tries cuDNN's kernel first (a no-op where ``chosen`` says
    "torch")."""
    if chosen(device) == "torch":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in ORDER], set_priority=True)
