"""Triton kernels for Hybrid 8-bit AdamW on GPU-resident blocks: the C kernel's update, on the device.

Why a kernel: the torch path runs ~35 ops per chunk, each a pass over memory and a launch; this
kernel reads the gradient, the master halves and the codes once and writes them once (~16 bytes of
traffic per parameter with an fp32 gradient), in one launch per block, asynchronously on the current
CUDA stream (nothing is read back to the host).

``hybrid8_kernel`` mirrors ``hybrid8_chunk`` of ``ckernel.py`` operation for operation, so states are
interchangeable bit for bit between a host and a device placement of a block:
- one program per quantization block of ``block_size`` elements (the shorter last block of a segment
  is masked); a small int64 table gives each program its (buffer offset, numel, code offset), and
  program ``j`` owns entry ``j`` of the per-block absmax arrays (the 8-bit layout of ``setup``);
- the same float operations in the same order: ``fma`` only where the C kernel calls ``fmaf``
  (the ``m`` EMA, mirroring torch's fused ``add_(alpha=)``), every other multiply and add rounded
  separately (launched with ``enable_fp_fusion=False``, the counterpart of ``-ffp-contract=off``),
  IEEE division and square root (``div_rn``, ``sqrt_rn``: Triton's ``/`` and ``sqrt`` on fp32 are
  approximate on NVIDIA GPUs);
- the same integer bit tricks on uint32 (logical shifts, wrap-around adds).

Decoding always uses the overflow-safe two-multiplication form: ``code_float * 2^112`` first (exact:
a power-of-two scaling of a value with at most 8 significant bits that lands in the normal range),
then ``* (absmax * extra / (top * 2^112))``.  ``extra / top`` and ``extra / (top * 2^112)`` differ by
exactly 2^112 and are both normal fp32 numbers, so they round to fp32 identically up to that power
of two; hence the per-block factor and the final product are the same real numbers scaled by
powers of two, and round to the same bits as the one-multiplication form ``code_float * (absmax *
extra / top)`` whenever that factor does not overflow (and its result is not subnormal, which needs
an absmax below ~1e-38).  The host picks the form from the global absmax maximum, which would need
a device-to-host read; the device never needs it.

``adamw32_kernel`` is ``adamw32_range`` (plain fp32 AdamW for the small tensors whose moments stay
fp32) over the packed small elements, gathered from the block buffers through an index table, so
all of a block's norms and biases take one launch.

``import triton`` happens only inside :func:`available` and the builders, so importing this module
never needs Triton (CI has none).
"""

from __future__ import annotations

import functools
import os

import torch

from . import quant as Q

_TWO_112 = 2.0**112


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when Triton imports (a GPU, or ``TRITON_INTERPRET=1`` for CPU tensors, is the caller's
    business: see :func:`usable_for`)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 (any import failure means: no fast path)
        return False
    return True


def usable_for(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA with Triton, or CPU tensors under
    Triton's interpreter (tests)."""
    if not available():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def _kernels():
    """Define the kernels on first use (Triton imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def hybrid8_kernel(
        table_ptr,  # int64 [nblocks, 3]: (buffer offset, numel, code offset) per quantization block
        g_ptr,  # gradient, fp32 or bf16
        hi_ptr,  # int16 view of the bf16 load buffer (HILO)
        lo_ptr,  # int16 low half of the master (HILO)
        p32_ptr,  # fp32 master (not HILO)
        mq_ptr,
        vq_ptr,  # uint8 codes of m and sqrt(v)
        m_am_ptr,
        v_am_ptr,  # fp32 per-block absmax, read then overwritten
        gm,
        gv,
        decay,
        inv_bc2,
        step,
        eps,
        m_ratio,
        v_ratio,
        HILO: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0)
        off = tl.load(table_ptr + 3 * j)
        n = tl.load(table_ptr + 3 * j + 1)
        qoff = tl.load(table_ptr + 3 * j + 2)
        i = tl.arange(0, BLOCK)
        mask = i < n
        g = tl.load(g_ptr + off + i, mask=mask, other=0.0).to(tl.float32)
        mf = tl.load(m_am_ptr + j) * m_ratio
        vf = tl.load(v_am_ptr + j) * v_ratio
        c = tl.load(mq_ptr + qoff + i, mask=mask, other=0).to(tl.uint32)
        m = (((c & 0x7F) << 20) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
        m = m * 5192296858534827628530496329220096.0  # 2^112: the overflow-safe decode
        m = m * mf
        m = tl.fma(g, gm, m)
        s = (tl.load(vq_ptr + qoff + i, mask=mask, other=0).to(tl.uint32) << 19).to(tl.float32, bitcast=True)
        s = s * 5192296858534827628530496329220096.0
        s = s * vf
        s = s * s
        s = s + (gv * g) * g
        s = tl.sqrt_rn(s)
        if HILO:
            hi = tl.load(hi_ptr + off + i, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            lo = tl.load(lo_ptr + off + i, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
        else:
            p = tl.load(p32_ptr + off + i, mask=mask, other=0.0)
        p = p * decay
        d = s * inv_bc2
        d = d + eps
        p = p + tl.div_rn(step * m, d)
        if HILO:
            bits = p.to(tl.uint32, bitcast=True)
            tl.store(lo_ptr + off + i, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
            nhi = (bits + 0x8000) >> 16
            tl.store(hi_ptr + off + i, nhi.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(p32_ptr + off + i, p, mask=mask)
        am = tl.where(mask, m.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)
        sm = tl.where(mask, s.to(tl.uint32, bitcast=True), 0)
        mx = tl.max(am, axis=0).to(tl.float32, bitcast=True)
        sx = tl.max(sm, axis=0).to(tl.float32, bitcast=True)
        tl.store(m_am_ptr + j, mx)
        tl.store(v_am_ptr + j, sx)
        signed_top = tl.full((), 127 << 20, tl.uint32).to(tl.float32, bitcast=True)
        unsigned_top = tl.full((), 255 << 19, tl.uint32).to(tl.float32, bitcast=True)
        # mx > 0 ? top / mx : 0, dividing by 1 instead of 0 so no lane ever computes top / 0
        me = tl.where(mx > 0, tl.div_rn(signed_top, tl.where(mx > 0, mx, 1.0)), 0.0)
        se = tl.where(sx > 0, tl.div_rn(unsigned_top, tl.where(sx > 0, sx, 1.0)), 0.0)
        x = (m * me).to(tl.uint32, bitcast=True)
        mag = ((x & 0x7FFFFFFF) + (1 << 19)) >> 20
        mag = tl.minimum(mag, 127)
        tl.store(mq_ptr + qoff + i, (mag | ((x >> 24) & 0x80)).to(tl.uint8), mask=mask)
        y = ((s * se).to(tl.uint32, bitcast=True) + (1 << 18)) >> 19
        y = tl.minimum(tl.maximum(y, 1), 255)
        tl.store(vq_ptr + qoff + i, y.to(tl.uint8), mask=mask)

    @triton.jit
    def adamw32_kernel(
        idx_ptr,  # int64 [n]: buffer offset of each packed small element
        n,
        g_ptr,
        hi_ptr,
        lo_ptr,
        p32_ptr,
        m_ptr,
        v_ptr,  # fp32 packed moments
        gm,
        gv,
        decay,
        inv_bc2,
        step,
        eps,
        b1,
        b2,
        HILO: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = k < n
        o = tl.load(idx_ptr + k, mask=mask, other=0)
        g = tl.load(g_ptr + o, mask=mask, other=0.0).to(tl.float32)
        m = tl.fma(g, gm, tl.load(m_ptr + k, mask=mask, other=0.0) * b1)
        v = tl.load(v_ptr + k, mask=mask, other=0.0) * b2
        v = v + (gv * g) * g
        tl.store(m_ptr + k, m, mask=mask)
        tl.store(v_ptr + k, v, mask=mask)
        if HILO:
            hi = tl.load(hi_ptr + o, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            lo = tl.load(lo_ptr + o, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
        else:
            p = tl.load(p32_ptr + o, mask=mask, other=0.0)
        p = p * decay
        d = tl.sqrt_rn(v) * inv_bc2
        d = d + eps
        p = p + tl.div_rn(step * m, d)
        if HILO:
            bits = p.to(tl.uint32, bitcast=True)
            tl.store(lo_ptr + o, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
            tl.store(hi_ptr + o, ((bits + 0x8000) >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(p32_ptr + o, p, mask=mask)

    return triton, hybrid8_kernel, adamw32_kernel


def hybrid8_step(
    table: torch.Tensor,
    block_size: int,
    grad: torch.Tensor,
    hi: torch.Tensor | None,
    lo: torch.Tensor | None,
    p32: torch.Tensor | None,
    mq: torch.Tensor,
    vq: torch.Tensor,
    m_am: torch.Tensor,
    v_am: torch.Tensor,
    hp: dict[str, float],
) -> None:
    """Launch the 8-bit update over every quantization block of ``table`` on the current stream.

    ``hi``/``lo`` (int16) for a bf16 load buffer, else ``p32`` (fp32 master); ``hp`` holds gm, gv,
    decay, inv_bc2_sqrt, step_size, eps, b1, b2 (python floats; they reach the kernel as fp32, as
    the C kernel's ``float hp[]``)."""
    nblocks = table.shape[0]
    if nblocks == 0:
        return
    triton, kernel, _ = _kernels()

    hilo = hi is not None
    dummy = mq  # an unused pointer argument still needs a tensor
    block = triton.next_power_of_2(block_size)
    kernel[(nblocks,)](
        table,
        grad,
        hi if hilo else dummy,
        lo if hilo else dummy,
        dummy if hilo else p32,
        mq,
        vq,
        m_am,
        v_am,
        hp["gm"],
        hp["gv"],
        hp["decay"],
        hp["inv_bc2_sqrt"],
        hp["step_size"],
        hp["eps"],
        hp["b1"] / (Q.SIGNED_TOP * _TWO_112),
        hp["sqrt_b2"] / (Q.UNSIGNED_TOP * _TWO_112),
        HILO=hilo,
        BLOCK=block,
        # the faster warp count for each block size [ledger: triton-adam-warps]
        num_warps=4 if block <= 2048 else 16,
        enable_fp_fusion=False,
    )


def adamw32_step(
    index: torch.Tensor,
    grad: torch.Tensor,
    hi: torch.Tensor | None,
    lo: torch.Tensor | None,
    p32: torch.Tensor | None,
    m32: torch.Tensor,
    v32: torch.Tensor,
    hp: dict[str, float],
) -> None:
    """Launch fp32 AdamW over the packed small elements (``index``: their offsets in the buffers)."""
    n = index.numel()
    if n == 0:
        return
    triton, _, kernel = _kernels()
    hilo = hi is not None
    dummy = m32
    block = 1024
    kernel[(triton.cdiv(n, block),)](
        index,
        n,
        grad,
        hi if hilo else dummy,
        lo if hilo else dummy,
        dummy if hilo else p32,
        m32,
        v32,
        hp["gm"],
        hp["gv"],
        hp["decay"],
        hp["inv_bc2_sqrt"],
        hp["step_size"],
        hp["eps"],
        hp["b1"],
        hp["b2"],
        HILO=hilo,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
    )
