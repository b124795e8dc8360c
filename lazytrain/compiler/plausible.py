"""Physical limits a measured hardware profile must respect, and re-measuring what breaks them.

A measurement can be wrong without being an error: another process on the GPU or the bus, a clock
still ramping up, a page-cache hit.  Comparing two noisy medians with each other (``duplex >
h2d``) fails on a machine where both are right within noise, and proves little where it passes.
The checks here are instead the limits no correct measurement can cross, each with ``TOLERANCE``
for the noise of a median over a few repeats:

- a copy cannot beat the fastest host link there is (``MAX_LINK_GBPS``), and a pageable copy, which
  goes through a pinned staging buffer, cannot beat the pinned one;
- copies both ways at once take at most as long as one after the other and at least as long as the
  faster of them alone: ``duplex`` lies between the serial rate (twice the bytes over the sum of the
  two times) and ``h2d + d2h``;
- no matmul beats ``MAX_TFLOPS``; fused attention, matmuls and a softmax, cannot beat the matmul
  rate (its length at half rate, ``attn_half_len``, has no limit but zero: a CPU's attention can be
  far from its peak at every length measured, and the fitted curve still meets the measurements);
- the fixed cost of a block launch, and Python's time to issue one op, lie in ``(1 us, 10 ms)`` /
  ``(1 us, 1 ms)``: outside, the fit or the timer is broken, not the machine;
- a dequantization cannot write faster than any GPU memory runs (``MAX_HBM_GBPS``);
- a collective's bus bandwidth cannot beat the fastest GPU link (``MAX_BUS_GBPS``), and a ring step's
  latency lies in ``[0, 10 ms)``.

``measure_checked`` runs one group of measurements, checks it, and measures it again up to
``RETRIES`` times; still implausible, it raises ``ImplausibleMeasurement``, one line naming the
figures and the limit they cross.
"""

from __future__ import annotations

from collections.abc import Callable

#: relative noise allowed on a median of a few repeats before a limit counts as crossed
TOLERANCE = 0.10
#: the fastest CPU-GPU link shipping (GH200's NVLink-C2C: 450 GB/s each way), with room to spare
MAX_LINK_GBPS = 1000.0
#: the fastest GPU-GPU link shipping (NVLink 5: 900 GB/s each way per GPU), with room to spare
MAX_BUS_GBPS = 2000.0
#: above any GPU memory's bandwidth shipping (B200: 8 TB/s), with room to spare: a dequantization writes to it
MAX_HBM_GBPS = 20000.0
#: above any dense bf16 rate shipping (B200: 2.25 PFLOP/s), with room to spare
MAX_TFLOPS = 5000.0
#: times a figure is measured again after the first try
RETRIES = 2


class ImplausibleMeasurement(RuntimeError):
    """A measured figure crossed a physical limit on every try."""


def problems(f: dict) -> list[str]:
    """The limits the figures in ``f`` (``HardwareProfile`` field names; absent ones are not checked) cross."""
    out = []
    slack = 1 + TOLERANCE

    def need(ok: bool, text: str) -> None:
        if not ok:
            out.append(text)

    for k in ("h2d_gbps", "d2h_gbps", "duplex_gbps", "pageable_h2d_gbps", "pageable_d2h_gbps"):
        if k in f:
            need(0 < f[k] <= MAX_LINK_GBPS, f"{k} {f[k]:.3g} GB/s is outside (0, {MAX_LINK_GBPS:g}]")
    for pinned, pageable in (("h2d_gbps", "pageable_h2d_gbps"), ("d2h_gbps", "pageable_d2h_gbps")):
        if pinned in f and pageable in f:
            need(f[pageable] <= f[pinned] * slack, f"{pageable} {f[pageable]:.3g} beats {pinned} {f[pinned]:.3g}")
    if {"h2d_gbps", "d2h_gbps", "duplex_gbps"} <= set(f) and min(f["h2d_gbps"], f["d2h_gbps"]) > 0:
        serial = 2 / (1 / f["h2d_gbps"] + 1 / f["d2h_gbps"])
        both = f["h2d_gbps"] + f["d2h_gbps"]
        need(serial / slack <= f["duplex_gbps"] <= both * slack,
             f"duplex_gbps {f['duplex_gbps']:.3g} is outside [{serial:.3g} one way after the other, "
             f"{both:.3g} both at full rate]")
    if "bf16_tflops" in f:
        need(0 < f["bf16_tflops"] <= MAX_TFLOPS, f"bf16_tflops {f['bf16_tflops']:.4g} is outside (0, {MAX_TFLOPS:g}]")
        for k in ("attn_fwd_tflops", "attn_bwd_tflops"):
            if k in f:
                need(0 < f[k] <= f["bf16_tflops"] * slack,
                     f"{k} {f[k]:.4g} is outside (0, bf16_tflops {f['bf16_tflops']:.4g}]")
    if "attn_half_len" in f:    # no upper limit: far from its peak at the lengths measured, the curve still
        need(f["attn_half_len"] >= 0, f"attn_half_len {f['attn_half_len']:.4g} is negative")   # meets them
    if "compute_efficiency" in f:
        need(0 < f["compute_efficiency"] <= 1, f"compute_efficiency {f['compute_efficiency']:.3g} is outside (0, 1]")
    if "kernel_overhead_s" in f:
        need(0 <= f["kernel_overhead_s"] < 10e-3,
             f"kernel_overhead_s {f['kernel_overhead_s']:.3g} is outside [0, 10 ms)")
    for k in ("op_dispatch_s", "op_dispatch_bwd_s"):
        if f.get(k):
            need(1e-6 < f[k] < 1e-3, f"{k} {f[k]:.3g} is outside (1 us, 1 ms)")
    if "collective_gbps" in f:
        need(0 < f["collective_gbps"] <= MAX_BUS_GBPS,
             f"collective_gbps {f['collective_gbps']:.3g} GB/s is outside (0, {MAX_BUS_GBPS:g}]")
    if "collective_latency_s" in f:
        need(0 <= f["collective_latency_s"] < 10e-3,
             f"collective_latency_s {f['collective_latency_s']:.3g} is outside [0, 10 ms)")
    for k in ("dequant_gbps", "dequant8_gbps"):
        if k in f:
            need(0 < f[k] <= MAX_HBM_GBPS, f"{k} {f[k]:.3g} GB/s is outside (0, {MAX_HBM_GBPS:g}]")
    for k in ("cpu_adam_gparams", "nvme_read_gbps", "nvme_write_gbps", "nvme_both_gbps"):
        if k in f:
            need(f[k] > 0, f"{k} {f[k]:.3g} is not positive")
    return out


def measure_checked(what: str, run: Callable[[], dict], log: Callable[[str], None] = lambda _: None) -> dict:
    """``run()`` (a dict of figures) until ``problems`` finds none, at most ``1 + RETRIES`` times."""
    for attempt in range(RETRIES + 1):
        figures = run()
        found = problems(figures)
        if not found:
            return figures
        log(f"  {what}: {'; '.join(found)}; measuring again ({attempt + 1} of {RETRIES})" if attempt < RETRIES
            else f"  {what}: {'; '.join(found)}")
    raise ImplausibleMeasurement(f"implausible measurement of {what} on {RETRIES + 1} tries: {'; '.join(found)}; is "
                                 "another process using the GPU, the bus or the disk? Measure again when it is idle")
