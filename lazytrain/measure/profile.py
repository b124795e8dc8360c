"""Measure this machine into a ``HardwareProfile`` (what ``lazytrain profile -o hw.json`` runs).

``measure(device=None, quick=False, disk_dir=None, verbose=True)`` times, each as the median of
several repeats after a warm-up:

- pinned host->GPU, GPU->host, and both at once (two CUDA streams; duplex = the sum of the two),
  then pageable copies; with CUDA events, 256 MB buffers (64 MB with ``quick``);
- the dense bf16 matmul rate (8192^3 GEMMs);
- fused causal attention (SDPA, head dim 128, 16 heads, 16k tokens a batch as the published figures
  are; smaller on the CPU) forward and backward at a short and a long key length, fitted to
  ``rate * s / (s + half_len)`` (``attn_fwd_tflops``, ``attn_bwd_tflops``, ``attn_half_len``);
- ``compute_efficiency``/``kernel_overhead_s`` from a transformer-like block (QKV and output
  projections, causal SDPA, a 4x MLP) run forward+backward at micro-batch 8 and 4 x 1024, fitted to
  ``3 * matmul_flops / (rate * efficiency) + attention + 2 * overhead`` as the built-in H200
  calibration is (attention at the rates just measured). The block has no norms or rotary
  embeddings, so it is a little more efficient than a real layer;
- fused fp32 AdamW on the host (``torch.optim.AdamW(fused=True)``, else ``foreach``) over 48M
  parameters (12M with ``quick``); the 8-bit rate is taken equal to it (no 8-bit kernel is measured);
- the disk as the NVMe tier uses it (``disk.disk_rates``): a 256 MiB state file (64 MiB with ``quick``) in
  ``disk_dir`` (default: the temp directory) overwritten in place (with fsync), read back with its page cache
  dropped, and one read while another is written, in the runtime's requests (8 MiB, 8 in flight), ``O_DIRECT``
  where the file system takes it; read, write, both at once and the request size and depth go in the profile;
- a quantized frozen base's dequantization (``dequant.dequant_rates``: a 7B layer's frozen parameters in NF4 and
  int8, dequantized into bf16 as ``runtime/quantized.py`` does it; ``dequant_gbps`` and ``dequant8_gbps``);
- CPU cores (affinity), host memory (physical or the cgroup limit), GPU memory;
- with more than one GPU visible, the collectives between them (``profile_collectives``: ring all-gather
  and reduce-scatter over NCCL, fitted to the cost model's ``collective_gbps`` and
  ``collective_latency_s``); with one, they keep the profile's modelled defaults.

Without CUDA the "GPU" is the CPU: matmul and the block run on the CPU in fp32 (what CPU mode
computes in; ``bf16_tflops`` then holds the fp32 rate), transfers are memcpy rates, and
``source`` says so. With ``quick=True`` this takes well under 30 s on a small CPU machine.
Progress goes to stderr.

Every figure is checked against physical limits (``implausible``: a copy cannot beat the bus, both
directions at once lie between one-after-the-other and the sum of the two, attention cannot beat the
matmul peak, ...); a figure that fails is measured again, up to ``RETRIES`` times (a noisy neighbour,
a clock ramping up), and ``measure`` raises if it still fails rather than write a profile that would
mislead every plan compiled with it.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import tempfile

import torch

from ..compiler.api import compile_model
from ..compiler.hardware import HardwareProfile, attention_flops
from ..compiler.plausible import measure_checked
from ..ir import OpKind
from ..models.gpt import GPT, GPTConfig
from ..runtime.optim.torch_adamw import TorchAdamW
from ..runtime.trainer import Trainer
from ..util.host import cpu_cores, host_memory_bytes
from .dequant import dequant_rates
from .disk import disk_rates
from .profile_collectives import GPU_SIZES, measure_collectives
from .timing import median_seconds

__all__ = ["measure"]


def _log(verbose: bool, text: str) -> None:
    if verbose:
        print(f"[lazytrain profile] {text}", file=sys.stderr, flush=True)


def _transfers(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of pinned and pageable copies each way and pinned both ways at once."""
    n = nbytes // 2  # bf16 elements
    gpu_a = torch.empty(n, dtype=torch.bfloat16, device=device)
    gpu_b = torch.empty(n, dtype=torch.bfloat16, device=device)
    pinned_a = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    pinned_b = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    pageable = torch.ones(n, dtype=torch.bfloat16)
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def h2d() -> None:
        with torch.cuda.stream(h2d_stream):
            gpu_a.copy_(pinned_a, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(h2d_stream)

    def d2h() -> None:
        with torch.cuda.stream(d2h_stream):
            pinned_b.copy_(gpu_b, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(d2h_stream)

    def both() -> None:
        h2d_stream.wait_stream(torch.cuda.current_stream(device))
        d2h_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(h2d_stream):
            gpu_a.copy_(pinned_a, non_blocking=True)
        with torch.cuda.stream(d2h_stream):
            pinned_b.copy_(gpu_b, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(h2d_stream)
        torch.cuda.current_stream(device).wait_stream(d2h_stream)

    gb = nbytes / 1e9
    return {
        "h2d_gbps": gb / median_seconds(h2d, repeats, device),
        "d2h_gbps": gb / median_seconds(d2h, repeats, device),
        "duplex_gbps": 2 * gb / median_seconds(both, repeats, device),
        "pageable_h2d_gbps": gb / median_seconds(lambda: gpu_a.copy_(pageable), repeats, device),
        "pageable_d2h_gbps": gb / median_seconds(lambda: pageable.copy_(gpu_b), repeats, device),
    }


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return nbytes / 1e9 / median_seconds(lambda: dst.copy_(src), repeats, torch.device("cpu"))


def _matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    iters = 5 if device.type == "cuda" else 1

    def run() -> None:
        for _ in range(iters):
            torch.mm(a, b)

    return 2 * size**3 * iters / median_seconds(run, repeats, device) / 1e12


def _block_seconds(device: torch.device, dtype: torch.dtype, batch: int, seq: int, hidden: int,
                   repeats: int) -> tuple[float, float]:
    """Forward+backward seconds of a transformer-like block, and its forward matmul FLOPs."""
    heads = max(1, hidden // 128)
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]
    weights = [(torch.randn(shape, device=device, dtype=dtype) * 0.02).requires_grad_() for shape in shapes]
    w_qkv, w_out, w_up, w_down = weights
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        q, k, v = (x @ w_qkv).view(batch, seq, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + attn.transpose(1, 2).reshape(batch, seq, hidden) @ w_out
        y = h + torch.nn.functional.gelu(h @ w_up) @ w_down
        y.sum().backward()

    params = sum(w.numel() for w in weights)
    return median_seconds(step, repeats, device), 2.0 * params * batch * seq


def _fit_block(device: torch.device, dtype: torch.dtype, batch: int, seq: int, hidden: int, repeats: int,
               tflops: float, attention: dict) -> tuple[float, float]:
    """``(compute_efficiency, kernel_overhead_s)`` fitted like the built-in calibration.

    Forward+backward at micro-batch ``batch`` and ``batch // 2`` is modelled as
    ``3 * matmul_flops / (tflops * efficiency) + attention + 2 * overhead``, the attention at the rates in
    ``attention`` (``HardwareProfile`` fields); two sizes give the slope (efficiency) and the intercept
    (overhead). If noise makes the fit meaningless, overhead is 0 and efficiency comes from the larger
    size alone.
    """
    probe = HardwareProfile(**{**_PROBE, **attention, "bf16_tflops": tflops})

    def matmul_seconds(b: int) -> tuple[float, float]:
        total, flops = _block_seconds(device, dtype, b, seq, hidden, repeats)
        attn = sum(probe.attention_seconds(attention_flops(b, seq, hidden, backward=bwd), 128, seq, bwd)
                   for bwd in (False, True))
        return max(total - attn, 1e-9), flops

    big_s, big_flops = matmul_seconds(batch)
    small_s, small_flops = matmul_seconds(batch // 2)
    peak = tflops * 1e12
    slope = (big_s - small_s) / (3 * (big_flops - small_flops))  # seconds per counted FLOP
    overhead = (big_s - 3 * big_flops * slope) / 2
    if slope <= 0 or overhead < 0 or 1 / (slope * peak) > 1:
        return min(1.0, 3 * big_flops / big_s / peak), 0.0
    return 1 / (slope * peak), overhead


#: on a CPU, attention's fitted half-rate length is at most this many times the longer length measured
CPU_MAX_HALF_LEN_RATIO = 4.0

#: placeholder figures for a profile used only to evaluate ``attention_seconds`` while measuring
_PROBE = dict(name="probe", gpu_name="probe", gpu_memory_bytes=1, host_memory_bytes=1, cpu_cores=1, bf16_tflops=1.0,
              compute_efficiency=1.0, kernel_overhead_s=0.0, h2d_gbps=1.0, d2h_gbps=1.0, duplex_gbps=1.0,
              pageable_h2d_gbps=1.0, pageable_d2h_gbps=1.0, cpu_adam_gparams=1.0, cpu_adam8_gparams=1.0,
              nvme_read_gbps=1.0, nvme_write_gbps=1.0, source="probe")


def _attention_seconds(device: torch.device, dtype: torch.dtype, tokens: int, seq: int, heads: int,
                       repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of causal SDPA over ``tokens`` (``tokens // seq`` sequences of ``seq``)."""
    batch = max(1, tokens // seq)
    q, k, v = (torch.randn(batch, heads, seq, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, 128, device=device, dtype=dtype)

    def forward() -> None:
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    fwd = median_seconds(forward, repeats, device)
    return fwd, max(median_seconds(both, repeats, device) - fwd, 1e-9)


def _attention_rates(device: torch.device, dtype: torch.dtype, tokens: int, lengths: tuple[int, int], heads: int,
                     repeats: int, matmul_tflops: float) -> dict[str, float]:
    """``attn_fwd_tflops``, ``attn_bwd_tflops`` and ``attn_half_len`` from causal attention at two key lengths:
    ``1 / rate = (1 + half_len / s) / peak`` is a line in ``1 / s`` through the two points (the forward
    fixes ``half_len``, which the backward shares).  The peak is at most the matmul rate (attention is
    matmuls and a softmax): where the line extrapolates past it (a CPU far from its peak at the lengths
    measured), the curve goes through the long length at that peak.  Noise that makes the short length
    faster: no length term, the long length's rate."""
    rates = {}
    for s in lengths:
        fwd_s, bwd_s = _attention_seconds(device, dtype, tokens, s, heads, repeats)
        flops = attention_flops(max(1, tokens // s), s, heads * 128)
        rates[s] = (flops / fwd_s / 1e12, 2.5 * flops / bwd_s / 1e12)
    short, long_ = lengths
    slope = (1 / rates[short][0] - 1 / rates[long_][0]) / (1 / short - 1 / long_)
    intercept = 1 / rates[long_][0] - slope / long_
    half = max(0.0, slope / intercept) if intercept > 0 else math.inf
    if rates[long_][0] * (long_ + half) / long_ > matmul_tflops:
        # (never negative: on a loaded machine the long length may time faster than the matmul did)
        half = max(0.0, long_ * (matmul_tflops / rates[long_][0] - 1))
    if device.type == "cpu":
        # a CPU's attention is far from its matmul peak at every length, so the line through two
        # points extrapolates the length term from noise (1,254 at keys of 256 on a loaded 2-core
        # machine): bound it to a rate at the longer length of at least a fifth of the fitted peak
        half = min(half, CPU_MAX_HALF_LEN_RATIO * long_)
    scale = (long_ + half) / long_
    return {"attn_fwd_tflops": min(rates[long_][0] * scale, matmul_tflops),
            "attn_bwd_tflops": min(rates[long_][1] * scale, matmul_tflops),
            "attn_half_len": half}


def _dispatch_seconds(device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds per forward op of a block too small for its kernels to matter,
    measured through LazyTrain's own runtime (fx program, autograd, saved-tensor hooks, streams):
    a tiny rotary GPT (57 ops per layer, as many as a Qwen2 layer's 54) whose every block is kept on
    the GPU, so no op waits for a transfer."""

    model = GPT(GPTConfig(vocab=64, d_model=64, n_layer=6, n_head=2, d_ff=128, max_seq=16, rope=True))
    model = model.to(torch.bfloat16)
    plan = compile_model(model, batch_size=1, seq_len=16, hardware="h200", gpu_memory="4GiB", host_memory="4GiB",
                         policy="keep-all", param_dtype="bfloat16", optimizer="adamw", resident="none")
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=0.0), device=device, profile=True, verbose=False)
    ids = torch.randint(0, 64, (1, 16))
    by_id = {op.id: op for op in plan.ops}
    layers = {b.index: b.fwd_ops for b in plan.graph.blocks if b.kind == "layer"}
    fwd, bwd = [], []
    try:
        for _ in range(repeats + 2):
            trainer.step((ids, ids))
            for i, _res, t0, t1 in trainer.last_profile.trace:
                op = by_id[i]
                if op.block in layers and op.kind in (OpKind.COMPUTE, OpKind.BACKWARD):
                    (fwd if op.kind is OpKind.COMPUTE else bwd).append((t1 - t0) / layers[op.block])
    finally:
        trainer.close()
    return statistics.median(fwd), statistics.median(bwd)


def _adam_gparams(n_params: int, repeats: int) -> tuple[float, str]:
    """Host AdamW rate in G params/s: fused if this torch supports it on the CPU, else foreach."""
    params = [torch.nn.Parameter(torch.randn(n_params // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    try:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        optimizer.step()
        kind = "fused"
    except (RuntimeError, TypeError, NotImplementedError):
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        kind = "foreach"
    seconds = median_seconds(optimizer.step, repeats, torch.device("cpu"))
    return sum(p.numel() for p in params) / seconds / 1e9, kind


def _disk(directory: str | None, nbytes: int, repeats: int) -> dict:
    """Read, write and both at once through the NVMe tier's own I/O path, at its request size and queue depth
    (``disk.disk_rates``); the ``HardwareProfile`` fields, and ``direct``."""
    return disk_rates(directory, nbytes, repeats=repeats)


def _collectives(on_gpu: bool, repeats: int, log) -> tuple[dict, str]:
    """Ring all-gather / reduce-scatter over every visible GPU (``profile_collectives``) when there are
    several, and the profile's note on where its collective figures come from."""
    gpus = torch.cuda.device_count() if on_gpu else 0
    if gpus < 2:
        return {}, "collectives modelled (one GPU visible)"
    log(f"collectives over {gpus} GPUs (NCCL), {len(GPU_SIZES)} buffer sizes ...")
    collectives = measure_checked("collectives", lambda: measure_collectives(gpus, "nccl", repeats=repeats), log)
    log(f"  {collectives['collective_gbps']:.1f} GB/s bus bandwidth, "
        f"{collectives['collective_latency_s'] * 1e6:.1f} us per ring step")
    return collectives, f"collectives measured over {gpus} GPUs (NCCL); between hosts modelled"


def _dequant(device: torch.device, quick: bool, repeats: int, log) -> tuple[dict, str]:
    """A quantized base's dequantization rates (``dequant.dequant_rates``: a 7B layer's frozen parameters, smaller
    on the CPU and with ``quick``), and the profile's note on them."""
    log("quantized-base dequantization (a 7B layer's matrices, NF4 and int8) ...")
    rates = measure_checked("dequantization", lambda: dequant_rates(device, quick, repeats), log)
    log(f"  NF4 {rates['dequant_gbps']:.3g} GB/s, int8 {rates['dequant8_gbps']:.3g} GB/s of bf16 out")
    return rates, "dequantization measured (runtime/quantized.py, bf16 out)"


def measure(device: str | torch.device | None = None, quick: bool = False, disk_dir: str | None = None,
            verbose: bool = True) -> HardwareProfile:
    """Measure this machine (see the module docstring); ``device`` defaults to ``cuda`` when available."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    repeats = 3 if quick else 7
    cores, host_memory = cpu_cores(), host_memory_bytes()
    log = functools.partial(_log, verbose)
    log(f"{'quick ' if quick else ''}measurement of {device} ({cores} host cores)")

    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        gpu_name, gpu_memory = props.name, props.total_memory
        copy_bytes = (64 if quick else 256) * 2**20
        log(f"PCIe copies, {copy_bytes >> 20} MB each ...")
        rates = measure_checked("PCIe copies", lambda: _transfers(device, copy_bytes, repeats), log)
        dtype, mm_size = torch.bfloat16, 8192
        batch, seq, hidden = 8, 1024, 2048
        attn_tokens, attn_lengths, attn_heads = 16384, ((1024, 4096) if quick else (1024, 16384)), 16
    else:
        gpu_name, gpu_memory = HardwareProfile.NO_GPU, host_memory
        log("no CUDA: the 'GPU' figures are this CPU's (fp32 matmul, memcpy for transfers)")
        rate = _memcpy_gbps((64 if quick else 256) * 2**20, repeats)
        rates = dict.fromkeys(("h2d_gbps", "d2h_gbps", "duplex_gbps", "pageable_h2d_gbps", "pageable_d2h_gbps"), rate)
        dtype, mm_size = torch.float32, (1024 if quick else 2048)
        batch, seq, hidden = (4, 256, 256) if quick else (4, 512, 512)
        attn_tokens, attn_lengths, attn_heads = (512, (64, 256), 2) if quick else (4096, (256, 2048), 4)
    log("  " + ", ".join(f"{k[:-5]} {v:.1f} GB/s" for k, v in rates.items()))

    log(f"{dtype} matmul {mm_size}^3 ...")
    tflops = measure_checked("matmul", lambda: {"bf16_tflops": _matmul_tflops(device, dtype, mm_size, repeats)},
                             log)["bf16_tflops"]
    log(f"  {tflops:.2f} TFLOP/s")

    log(f"causal attention, head dim 128, {attn_heads} heads, {attn_tokens} tokens, keys {attn_lengths} ...")
    attention = measure_checked(
        "attention", lambda: {"bf16_tflops": tflops, **_attention_rates(device, dtype, attn_tokens, attn_lengths,
                                                                          attn_heads, repeats, tflops)},
        log)
    attention.pop("bf16_tflops")
    log(f"  forward {attention['attn_fwd_tflops']:.3g}, backward {attention['attn_bwd_tflops']:.3g} TFLOP/s at "
        f"long keys, half at {attention['attn_half_len']:.0f}")

    log(f"transformer-like block, micro-batch {batch} and {batch // 2} x {seq}, hidden {hidden}, "
        "forward+backward ...")
    fit = measure_checked("block fit", lambda: dict(zip(("compute_efficiency", "kernel_overhead_s"), _fit_block(
        device, dtype, batch, seq, hidden, repeats, tflops, attention))), log)
    log(f"  efficiency {fit['compute_efficiency']:.3f}, overhead {fit['kernel_overhead_s'] * 1e6:.0f} us/launch")

    dispatch = {"op_dispatch_s": 0.0, "op_dispatch_bwd_s": 0.0}
    if on_gpu:      # on the CPU, issuing an op and running it are the same thread's time: in the efficiency
        log("dispatch floor (a tiny model through the runtime) ...")
        dispatch = measure_checked("dispatch", lambda: dict(zip(dispatch, _dispatch_seconds(device, repeats))), log)
        log(f"  {dispatch['op_dispatch_s'] * 1e6:.1f} us per op forward, {dispatch['op_dispatch_bwd_s'] * 1e6:.1f} "
            "backward")

    adam_params = (12 if quick else 48) * 2**20
    log(f"host AdamW over {adam_params / 1e6:.0f}M params ...")
    adam, adam_kind = _adam_gparams(adam_params, repeats)
    log(f"  {adam:.2f} G params/s ({adam_kind})")

    disk_bytes = (64 if quick else 256) * 2**20
    log(f"disk, {disk_bytes >> 20} MiB files in {disk_dir or tempfile.gettempdir()} ...")
    disk = measure_checked("disk", lambda: _disk(disk_dir, disk_bytes, 1 if quick else 3), log)
    direct = disk.pop("direct")
    log(f"  read {disk['nvme_read_gbps']:.2f} GB/s, write {disk['nvme_write_gbps']:.2f} GB/s, both at once "
        f"{disk['nvme_both_gbps']:.2f} GB/s ({disk['nvme_queue_depth']} x {disk['nvme_request_bytes'] >> 20} MiB "
        f"requests, {'direct' if direct else 'buffered'} I/O)")

    dequant, dequant_note = _dequant(device, quick, repeats, log)

    collectives, coll_note = _collectives(on_gpu, repeats, log)
    where = (f"measured on {gpu_name}" if on_gpu else
             "measured on the CPU without CUDA: GPU figures are the CPU's (fp32 matmul, memcpy transfers)")
    profile = HardwareProfile(
        name="measured", gpu_name=gpu_name, gpu_memory_bytes=int(gpu_memory), host_memory_bytes=int(host_memory),
        cpu_cores=cores, bf16_tflops=tflops, **fit, **rates, **attention, **dispatch, **collectives,
        cpu_adam_gparams=adam, cpu_adam8_gparams=adam, **disk, **dequant,
        source=f"{where} by lazytrain profile{' (quick)' if quick else ''}, torch {torch.__version__}; "
        f"{adam_kind} AdamW; 8-bit optimizer rate assumed equal to fp32 (not measured); "
        f"disk = {disk_dir or tempfile.gettempdir()} ({'direct' if direct else 'buffered'} I/O); {dequant_note}; "
        f"{coll_note}",
    )
    log(str(profile))
    return profile
