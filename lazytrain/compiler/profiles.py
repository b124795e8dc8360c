"""The built-in hardware profiles (``PROFILES``: ``compile(..., hardware="h200")``) and where their figures come
from; ``get_profile`` finds a profile by its name or its file.  How the figures turn FLOPs and bytes into seconds
is ``hardware.py``'s docstring.

``h200`` is the measured one: its matmul efficiency and per-launch overhead are fitted to one eager Qwen2.5-3B
layer and scaled by what LazyTrain's exported blocks measured slower; its transfer and host-update rates are
measured on an H200 host (``benchmarks/results/h200_reference.md``).  Its attention rates are modelled from
cuDNN's published H100 figures, not measured (``lazytrain profile`` measures them): SDPA on Hopper runs cuDNN's
fused attention, and the H200 has the H100's SMs and clocks.  The measurements and fits behind each constant are
in the tuning ledger (``benchmarks/results/tuning_ledger.md``, under the key each constant names).

The other built-ins come from public spec sheets, adjusted the same way as the measured H200 (achievable dense
bf16 ~ 0.78x of the spec sheet, pinned PCIe ~ 87% of the link), with the H200's efficiency and its attention
rates scaled by their matmul rate:

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
gen4 NVMe). - ``workstation``: the ``rtx4090`` GPU on a 128 GiB, 16-core host whose state tier is one
datacenter PCIe 4.0 NVMe drive (6.5/3.5 GB/s, 5 both at once, Samsung PM9A3 spec); ``workstation-4nvme``: four
such drives in RAID 0 (22/12/16 GB/s); the ``source`` of each says where every figure comes from. - Host figures
other than H200's (pageable copies, CPU AdamW, NVMe) are estimates: fused
AdamW reads and writes ~28 bytes per parameter, so its rate follows host memory bandwidth and cores;
pageable copies run at ~1/5 (H2D) and ~1/3 (D2H) of pinned. The 8-bit optimizer rate of every built-in
but ``h200`` is assumed equal to the fp32 rate (the optimizer's target); a measured profile overrides it
[ledger: h200-host-rates].
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
        dequant_gbps=0.1 * cores, dequant8_gbps=0.15 * cores,
        source="built-in: nominal per-core CPU figures, cores and memory of this machine; "
        "transfers are memcpy; 8-bit optimizer rate assumed equal to fp32; dequantization as measured on 2 shared "
        "cores (0.135 and 0.217 GB/s, NF4 and int8, bf16 out)",
    )


#: an eager layer's matmul efficiency and per-launch seconds, fitted to a Qwen2.5-3B layer [ledger: h200-eager-fit]
EAGER_LAYER_EFFICIENCY = 0.677
EAGER_LAYER_OVERHEAD_S = 0.365e-3
#: causal attention TFLOP/s at long keys (fwd, bwd), half-rate key length; modelled [ledger: hopper-attention]
HOPPER_ATTENTION = {"attn_fwd_tflops": 552.0, "attn_bwd_tflops": 480.0, "attn_half_len": 385.0}
#: how much slower LazyTrain's exported blocks run than the eager-layer fit: 1.15x [ledger: exported-block-slowdown]
EXPORTED_BLOCK_SLOWDOWN = 1.15

#: Python and autograd seconds per forward op, in the forward and in the backward [ledger: dispatch-floor]
DISPATCH_FWD_S = 30e-6
DISPATCH_BWD_S = 63e-6

#: the h200 profile's host memory: what ``free`` shows of an H200 host's 128 GiB [ledger: h200-host-memory]
H200_HOST_BYTES = 125 * GiB

#: NVLink 4 all-gather bus GB/s, seconds a ring step, inter-host GB/s a GPU; modelled [ledger: nvlink-collectives]
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

#: one datacenter PCIe 4.0 drive (Samsung PM9A3 U.2 spec: 6.5 GB/s read, 3.5 write), both at once
_PM9A3 = {"nvme_read_gbps": 6.5, "nvme_write_gbps": 3.5, "nvme_both_gbps": 5.0}
#: the requests the NVMe tier keeps in flight and the bytes of each (``runtime/nvme.py``)
_NVME_IO = {"nvme_queue_depth": 8, "nvme_request_bytes": 8 * MiB}
_WORKSTATION = dataclasses.replace(
    PROFILES["rtx4090"], name="workstation", host_memory_bytes=128 * GiB, cpu_cores=16, **_PM9A3, **_NVME_IO,
    source="built-in: the rtx4090 profile's GPU and PCIe 4.0 figures (RTX 4090, 24 GB) on a 16-core host with "
    "128 GiB of RAM and one datacenter PCIe 4.0 x4 NVMe drive for the state tier: Samsung PM9A3 (U.2) spec sheet "
    "6.5 GB/s sequential read, 3.5 GB/s sequential write (heise and ComputerBase on Samsung's data sheet, 2020); an "
    "enterprise drive's write figure is steady state, where a consumer drive's 5-7 GB/s holds only until its SLC "
    "cache fills (TechPowerUp: 200-400 GB, then 1.4-2 GB/s) and a step rewrites more state than that; both at once "
    "5.0 GB/s: a little above one direction after the other (4.55 GB/s), as flash dies serve one operation at a time; "
    "measured at 8 requests of 8 MiB in flight, as the runtime issues them; " + _AS_CALIBRATED,
)
PROFILES["workstation"] = _WORKSTATION
PROFILES["workstation-4nvme"] = dataclasses.replace(
    _WORKSTATION, name="workstation-4nvme", nvme_read_gbps=22.0, nvme_write_gbps=12.0, nvme_both_gbps=16.0,
    source="built-in: the workstation profile with its state tier on a RAID 0 of four PM9A3-class PCIe 4.0 x4 drives "
    "(a 4-slot x16 carrier card, 31.5 GB/s of link, so the drives limit): 4 x 6.5 = 26 GB/s read and 4 x 3.5 = 14 "
    "GB/s write at perfect striping, taken at ~85% (22 and 12 GB/s) for the striping layer and the CPU's I/O path, "
    "as reviews of four PCIe 4.0 drives in RAID 0 measure 16-26 GB/s sequential (Hardwareluxx: four WD_Black SN850 on "
    "an ASUS Hyper M.2 x16 Gen4, 2021); both at once 16 GB/s: four times the one drive's 5.0 at the same ~80%; "
    + _AS_CALIBRATED,
)


#: HBM bandwidth of each built-in's GPU, GB/s (spec sheets), for the dequantization estimates
_HBM_GBPS = {"h200": 4800.0, "h100": 3350.0, "h800": 3350.0, "a100-80g": 2039.0, "rtx3090": 936.0,
             "rtx4090": 1008.0, "workstation": 1008.0, "workstation-4nvme": 1008.0}
#: the dequantization's GPU memory traffic per byte it writes (bf16 out), as ``runtime/quantized.py`` runs it: NF4
#: reads the packed byte (0.5 B a value), writes and reads its int32 index (2 + 2), writes and reads the looked-up
#: value (2 + 2) and writes the result (2): 10.5 B a value, 5.25 per output byte; int8 reads 1 B and writes 2: 1.5
NF4_TRAFFIC_PER_BYTE = 5.25
INT8_TRAFFIC_PER_BYTE = 1.5
#: the share of HBM bandwidth a streaming elementwise kernel reaches (~80% on Hopper and Ampere)
HBM_STREAM_EFFICIENCY = 0.8


def dequant_estimate(hbm_gbps: float) -> dict[str, float]:
    """``dequant_gbps`` and ``dequant8_gbps`` of a GPU with this HBM bandwidth, until measured."""
    rate = hbm_gbps * HBM_STREAM_EFFICIENCY
    return {"dequant_gbps": rate / NF4_TRAFFIC_PER_BYTE, "dequant8_gbps": rate / INT8_TRAFFIC_PER_BYTE}


for _name, _hbm in _HBM_GBPS.items():
    PROFILES[_name] = dataclasses.replace(
        PROFILES[_name], **dequant_estimate(_hbm),
        source=PROFILES[_name].source + f"; quantized-base dequantization estimated from {_hbm:.0f} GB/s of HBM "
        "(profiles.dequant_estimate), not measured")


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
