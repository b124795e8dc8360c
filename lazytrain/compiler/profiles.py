"""The built-in hardware profiles (``PROFILES``: ``compile(..., hardware="h200")``) and where their figures come
from; ``get_profile`` finds a profile by its name or its file.  How the figures turn FLOPs and bytes into seconds
is ``hardware.py``'s docstring.

Calibration of ``h200`` (benchmarks/results/h200_reference.md): one Qwen2.5-3B layer (77,076,992
params, hidden 2048, head dim 128), seq 1024, eager bf16 + SDPA: forward 2.77 ms and
forward+backward 8.48 ms at micro-batch 8, forward+ backward 4.62 ms at micro-batch 4. Forward FLOPs
at micro-batch 8: 1.263e12 of matmuls and 0.034e12 of causal attention (0.086e12 in its backward),
the attention priced at the rates below. A least-squares fit of (efficiency, overhead) to the
relative error of those three times gives ``compute_efficiency = 0.677`` and ``kernel_overhead_s =
0.365 ms``, reproducing 2.87 ms (+4%), 8.32 ms (-2%) and 4.53 ms (-2%). (Efficiency alone, no
overhead, misses micro-batch 4 by 9%: small micro-batches do pay a fixed cost.) The overhead is
mostly eager-mode launches and memory-bound elementwise kernels (norms, rotary, activations); with
``torch.compile`` the same layer ran 1.37x faster.

The H200's attention rates are **modelled, not measured** (``lazytrain profile`` measures them):
SDPA on Hopper runs cuDNN's fused attention (PyTorch prefers it on sm90 from cuDNN 9.15, bundled
with torch 2.11 and later), whose published H100 SXM5 bf16 figures (FlashAttention-3 paper, Shah et
al. 2024; 16k tokens per batch, hidden 2048) are, for causal forward at head dim 128, 315 / 410 /
484 / 518 / 529 / 539 TFLOP/s at 512 / 1k / 2k / 4k / 8k / 16k keys: ``552 * s / (s + 385)`` within
4%. Its backward is published without the causal mask only (305 ... 516, long-key 530); times the
forward's causal / full ratio at long keys (539 / 595): 480. The H200 has the H100's SMs and clocks
(attention is compute bound), so the figures carry over; other GPUs scale them by their
``bf16_tflops``.

Sources of the other built-ins, all public spec sheets, adjusted the same way as the measured H200
(achievable dense bf16 ~ 0.78x of the spec sheet, pinned PCIe ~ 87% of the link):

- ``h100``: H100 SXM5 80 GB HBM3, 989 TFLOP/s dense bf16 spec (NVIDIA H100 datasheet), PCIe gen5 x16
(64 GB/s per direction); host = one GPU's share of an 8-GPU HGX node (AWS p5: 192 vCPU and 2 TiB per
8 GPUs). - ``h800``: the China-market H100 SXM: same die, memory and PCIe; only NVLink is cut (400
GB/s), which a one-GPU trainer does not use, so the figures equal ``h100``. - ``a100-80g``: A100
SXM4 80 GB, 312 TFLOP/s dense bf16 spec (A100 datasheet), PCIe gen4 x16 (32 GB/s per direction, ~25
measured pinned); host = one GPU's share of a DGX A100 (256 cores, 2 TB per 8 GPUs, rounded down to
what cloud instances give: 16 cores, 128 GiB). - ``rtx3090``: 24 GB GDDR6X, 71 TFLOP/s dense bf16
with fp32 accumulate (NVIDIA Ampere GA102 whitepaper), PCIe gen4; consumer host (8 cores, 64 GiB,
dual-channel DDR4, consumer NVMe). - ``rtx4090``: 24 GB GDDR6X, 165 TFLOP/s dense bf16 with fp32
accumulate (Ada AD102 whitepaper), PCIe gen4; consumer host (16 cores, 64 GiB, dual-channel DDR5,
gen4 NVMe). - Host figures other than H200's (pageable copies, CPU AdamW, NVMe) are estimates: fused
AdamW reads and writes ~28 bytes per parameter, so its rate follows host memory bandwidth and cores
(H200 host: 5.5 G params/s on 16 cores); pageable copies run at ~1/5 (H2D) and ~1/3 (D2H) of pinned
as on the H200 host. The 8-bit optimizer rate is not measured anywhere yet, so every built-in
assumes it equals the fp32 rate (the optimizer's target); a measured profile overrides it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..util.host import cpu_cores, host_memory_bytes
from .hardware import HardwareProfile

GiB = 2**30
MiB = 2**20


def _cpu_profile() -> HardwareProfile:
    """CPU mode on this machine: the "GPU" is the host, so its memory and rates are the host's.

    Cores and memory are read from this machine; the rates are nominal per-core figures (about
    50 GFLOP/s fp32 per core, memcpy ~10 GB/s, fused AdamW 0.2 G params/s per core), good enough to
    compile a plan for CPU-mode tests. Run ``lazytrain.measure.profile.measure()`` for real ones.
    """
    cores = cpu_cores()
    memory = host_memory_bytes()
    return HardwareProfile(
        name="cpu", gpu_name=HardwareProfile.NO_GPU, gpu_memory_bytes=memory, host_memory_bytes=memory,
        cpu_cores=cores, bf16_tflops=0.05 * cores, compute_efficiency=0.5, kernel_overhead_s=50e-6,
        h2d_gbps=10.0, d2h_gbps=10.0, duplex_gbps=10.0, pageable_h2d_gbps=10.0, pageable_d2h_gbps=10.0,
        cpu_adam_gparams=0.2 * cores, cpu_adam8_gparams=0.2 * cores, nvme_read_gbps=1.0, nvme_write_gbps=1.0,
        source="built-in: nominal per-core CPU figures, cores and memory of this machine; "
        "transfers are memcpy; 8-bit optimizer rate assumed equal to fp32",
    )


#: fitted to the eager Qwen2.5-3B layer of benchmarks/results/h200_reference.md (forward 2.77 ms, fwd+bwd
#: 8.48 ms at micro-batch 8), its attention priced at the rates below (module docstring)
EAGER_LAYER_EFFICIENCY = 0.677
EAGER_LAYER_OVERHEAD_S = 0.365e-3
#: published cuDNN attention on the H100 SXM5 (module docstring): causal forward and backward TFLOP/s at
#: long keys, head dim 128, and the key length at which they are halved -- modelled, not measured
HOPPER_ATTENTION = {"attn_fwd_tflops": 552.0, "attn_bwd_tflops": 480.0, "attn_half_len": 385.0}
#: LazyTrain's blocks are the torch.export'ed Hugging Face layers plus the chunked-loss head.  Measured on
#: the H200 (qwen2.5-3b, seq 1024, 24 GiB, is_causal attention), GPU busy per step against the eager-layer
#: fit: megatrain b32 1.992 s / 1.783, milp b32 1.789-1.871 / 1.665, megatrain b8 0.505-0.540 / 0.461,
#: milp b8 0.471-0.524 / 0.413: 1.12x on average (the explicit-mask attention it replaced was 1.16x).  That fit
#: counted attention as FlopCounterMode does (full square, backward 2x); with attention apart at its own rate
#: the same plans predict 2.7% less GPU work (megatrain b32 1.736 s vs 1.785, b8 0.455 vs 0.467): 1.12 / 0.973
EXPORTED_BLOCK_SLOWDOWN = 1.15

#: Dispatch floor, measured in LazyTrain's runtime on the H200 host (qwen2.5-0.5b, batch 32, seq 88, all
#: blocks resident so no op waits for a transfer): a 54-op Qwen2 layer's forward took 1.644 ms and its
#: backward 3.402 ms (medians of 24 layers) against 0.55 / 0.73 ms of kernels -- 30.4 and 63.0 us per
#: forward op.  The other GPU profiles assume a host CPU as fast (it is Python and autograd, not the GPU).
DISPATCH_FWD_S = 30e-6
DISPATCH_BWD_S = 63e-6

#: the lent H200 machine's host memory (``free``: 125 GiB total; a plan sized for 128 GiB was refused there)
H200_HOST_BYTES = 125 * GiB

#: Collective figures of the NVLink machines, modelled from published figures, not measured (one GPU was
#: lent): NVLink 4 moves 450 GB/s each way per H100/H200; NCCL's all-gather bus bandwidth on 8 of them is
#: about 360 GB/s (nccl-tests), ~8 us per ring step at small sizes, taken as 20 us in the eager runtime.
#: Between hosts, one 400 Gb/s NDR InfiniBand port per GPU: 50 GB/s, ~45 reached.
NVLINK4_BUS_GBPS = 360.0
NCCL_STEP_LATENCY_S = 20e-6
NDR_GPU_GBPS = 45.0

_H200 = HardwareProfile(
    name="h200", gpu_name="NVIDIA H200", gpu_memory_bytes=139 * GiB, host_memory_bytes=H200_HOST_BYTES, cpu_cores=16,
    bf16_tflops=770.0, compute_efficiency=EAGER_LAYER_EFFICIENCY / EXPORTED_BLOCK_SLOWDOWN,
    kernel_overhead_s=EAGER_LAYER_OVERHEAD_S,
    h2d_gbps=55.4, d2h_gbps=55.4, duplex_gbps=99.6, pageable_h2d_gbps=8.9, pageable_d2h_gbps=15.7,
    cpu_adam_gparams=5.5, cpu_adam8_gparams=5.0, nvme_read_gbps=1.6, nvme_write_gbps=1.6,
    op_dispatch_s=DISPATCH_FWD_S, op_dispatch_bwd_s=DISPATCH_BWD_S, **HOPPER_ATTENTION,
    collective_gbps=NVLINK4_BUS_GBPS, collective_latency_s=NCCL_STEP_LATENCY_S, internode_gbps=NDR_GPU_GBPS,
    internode_latency_s=NCCL_STEP_LATENCY_S,
    source="measured on the lent H200 machine (benchmarks/results/h200_reference.md); matmul efficiency and "
    "overhead fitted to one eager "
    f"Qwen2.5-3B layer ({EAGER_LAYER_EFFICIENCY}), then scaled by the {EXPORTED_BLOCK_SLOWDOWN}x that LazyTrain's "
    "exported blocks measured slower (GPU busy per step, qwen2.5-3b seq 1024); attention rates modelled from "
    "published cuDNN figures on the H100 (not measured); 8-bit optimizer rate measured "
    "inside LazyTrain's runtime on that machine, 14 threads, while the GPU streams: 5.07 G/s (qwen2.5-3b, 3.09 B "
    "params in 0.609 s), 5.40 G/s (qwen2.5-7b, 7.61 B in 1.411 s), 4.6-5.1 in other runs; 5.98 G/s for the "
    "kernel alone; collectives modelled, not measured (NVLink 4, one 400 Gb/s NDR port per GPU between hosts)",
)

#: how the built-ins other than h200 take their compute figures
_AS_CALIBRATED = ("efficiency as calibrated on H200; attention: H200's modelled rates scaled by the matmul rate; "
                  "8-bit rate assumed = fp32")


def _scaled_attention(bf16_tflops: float) -> dict:
    """The H200's modelled attention rates scaled to a GPU with this matmul rate (attention is compute bound)."""
    scale = bf16_tflops / _H200.bf16_tflops
    return {k: v * scale if k != "attn_half_len" else v for k, v in HOPPER_ATTENTION.items()}


_H100 = dataclasses.replace(
    _H200, name="h100", gpu_name="NVIDIA H100 80GB HBM3 (SXM5)", gpu_memory_bytes=81559 * MiB,
    host_memory_bytes=256 * GiB, cpu_cores=24, bf16_tflops=770.0,
    h2d_gbps=55.0, d2h_gbps=55.0, duplex_gbps=99.0, pageable_h2d_gbps=10.0, pageable_d2h_gbps=16.0,
    cpu_adam_gparams=7.5, cpu_adam8_gparams=7.5, nvme_read_gbps=6.5, nvme_write_gbps=3.5,
    source="built-in from spec sheets: H100 SXM5 989 TFLOP/s dense bf16 spec, achievable as measured on "
    "the same die (H200); PCIe gen5 x16 as measured on the H200 HGX host; host = 1/8 of an HGX node "
    "(24 cores, 256 GiB); datacenter gen4 NVMe; " + _AS_CALIBRATED,
)
PROFILES: dict[str, HardwareProfile] = {
    "h200": _H200,
    "h100": _H100,
    "h800": dataclasses.replace(
        _H100, name="h800", gpu_name="NVIDIA H800 80GB HBM3 (SXM5)", collective_gbps=NVLINK4_BUS_GBPS * 400 / 900,
        source="built-in: H800 SXM5 = H100 SXM5 with NVLink cut to 400 GB/s (unused by one GPU); figures as h100",
    ),
    "a100-80g": dataclasses.replace(
        _H200, name="a100-80g", gpu_name="NVIDIA A100-SXM4-80GB", gpu_memory_bytes=81920 * MiB,
        host_memory_bytes=128 * GiB, cpu_cores=16, bf16_tflops=250.0, compute_efficiency=EAGER_LAYER_EFFICIENCY,
        kernel_overhead_s=EAGER_LAYER_OVERHEAD_S,
        **_scaled_attention(250.0),
        h2d_gbps=25.0, d2h_gbps=25.0, duplex_gbps=42.0,
        pageable_h2d_gbps=8.0, pageable_d2h_gbps=10.0, cpu_adam_gparams=4.5, cpu_adam8_gparams=4.5,
        nvme_read_gbps=6.0, nvme_write_gbps=3.0, collective_gbps=NVLINK4_BUS_GBPS * 600 / 900,
        internode_gbps=22.0,
        source="built-in from spec sheets: A100 SXM4 312 TFLOP/s dense bf16 spec (~250 achievable), PCIe "
        "gen4 x16 ~25 GB/s pinned; host 16 cores 128 GiB; " + _AS_CALIBRATED,
    ),
    "rtx3090": dataclasses.replace(
        _H200, name="rtx3090", gpu_name="NVIDIA GeForce RTX 3090", gpu_memory_bytes=24576 * MiB,
        host_memory_bytes=64 * GiB, cpu_cores=8, bf16_tflops=62.0, compute_efficiency=EAGER_LAYER_EFFICIENCY,
        kernel_overhead_s=EAGER_LAYER_OVERHEAD_S,
        **_scaled_attention(62.0),
        h2d_gbps=24.0, d2h_gbps=24.0, duplex_gbps=40.0,
        pageable_h2d_gbps=8.0, pageable_d2h_gbps=8.0, cpu_adam_gparams=1.2, cpu_adam8_gparams=1.2,
        nvme_read_gbps=3.5, nvme_write_gbps=2.5, collective_gbps=20.0, internode_gbps=12.5,
        source="built-in from spec sheets: RTX 3090 71 TFLOP/s dense bf16 (fp32 accumulate) spec, ~62 achievable; "
        "PCIe gen4 x16; consumer host 8 cores 64 GiB DDR4; " + _AS_CALIBRATED,
    ),
    "rtx4090": dataclasses.replace(
        _H200, name="rtx4090", gpu_name="NVIDIA GeForce RTX 4090", gpu_memory_bytes=24564 * MiB,
        host_memory_bytes=64 * GiB, cpu_cores=16, bf16_tflops=150.0, compute_efficiency=EAGER_LAYER_EFFICIENCY,
        kernel_overhead_s=EAGER_LAYER_OVERHEAD_S,
        **_scaled_attention(150.0),
        h2d_gbps=25.0, d2h_gbps=25.0, duplex_gbps=40.0,
        pageable_h2d_gbps=10.0, pageable_d2h_gbps=10.0, cpu_adam_gparams=2.0, cpu_adam8_gparams=2.0,
        nvme_read_gbps=6.0, nvme_write_gbps=4.0, collective_gbps=20.0, internode_gbps=12.5,
        source="built-in from spec sheets: RTX 4090 165 TFLOP/s dense bf16 (fp32 accumulate) spec, ~150 achievable; "
        "PCIe gen4 x16; consumer host 16 cores 64 GiB DDR5, gen4 NVMe; " + _AS_CALIBRATED,
    ),
    "cpu": _cpu_profile(),
}


def get_profile(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A built-in by name (case-insensitive) or a JSON file written by ``lazytrain profile``."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"hardware must be a profile's name, a JSON file written by `lazytrain profile` or a "
                         f"HardwareProfile, got {name_or_path!r}")
    key = str(name_or_path).strip().lower()
    if key in PROFILES:
        return PROFILES[key]
    path = Path(name_or_path)
    if path.is_file():
        return HardwareProfile.load(path)
    if path.suffix == ".json" or os.sep in str(name_or_path):
        raise ValueError(f"hardware profile file {str(name_or_path)!r} does not exist")
    raise ValueError(
        f"unknown hardware {str(name_or_path)!r}: use one of {', '.join(PROFILES)} "
        f"or a JSON file written by `lazytrain profile -o hw.json`"
    )
