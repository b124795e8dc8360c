"""Hybrid 8-bit AdamW: block-wise 8-bit moments, fp32 moments for small tensors, a bf16+16-bit master.

Memory (``docs/architecture.md``, "The runtime"): with the runtime's bf16 load buffer (2 B) and bf16
gradient buffer (2 B), the optimizer adds per parameter
- 2 B: the low 16 bits of the fp32 master.  The load buffer holds the *round-to-nearest* bf16 of the
  master (what the GPU should compute with) and ``lo = bits(master) - (bf16_bits << 16)``, an int16
  in [-2^15, 2^15); ``(hi << 16) + lo`` gives the fp32 master back exactly, so the master costs
  2 extra bytes instead of 4 and there is no drift between master and load buffer.
- 1 B: m, signed code;  1 B: sqrt(v), unsigned code (see ``quant.py`` for the codes and why);
- 8 B per ``block_size`` parameters: one fp32 absmax for m and one for sqrt(v).
With ``stochastic_rounding=True`` (the ``hybrid8bit-sr`` optimizer choice) a bf16 load buffer is the
whole master: the update computes the new fp32 value from it and writes it back rounded
stochastically (``sr.py``: unbiased, with random bits hashed from (seed, block, step, element), so runs
and resumes repeat bit for bit), and there is no ``lo`` (6.25 instead of 8.25 B/param with the
runtime's buffers).  It runs on the host only: GPU-resident and GPU-updated blocks are refused
(``NO_DEVICE_SR``; the compiler plans none for it).  Its checkpoint keys are the same (``master`` is
the bf16 master as fp32), so a checkpoint of either master loads into the other (a split master's low
half is then rounded to nearest).
With ``moment_bits=4`` (the ``hybrid4bit`` / ``hybrid4bit-sr`` choices) the codes are ``quant4.py``'s, two a
byte, over 128-element quantization blocks: 0.5 + 0.5 B instead of 1 + 1 and 8 B of absmax per 128 parameters
(7.06 / 5.06 B/param with the runtime's buffers, the exact / stochastic master).  Host updates only, as for
``-sr`` (``NO_DEVICE_4BIT``); a state of one width does not load into the other (``load_hyperparameters``,
``load_state_tensors``: the codes are not converted).
Tensors (segments) with fewer than ``min_8bit_numel`` elements (norms, biases) keep fp32 m and v:
they are a negligible fraction of the parameters and the most sensitive to quantization.
Total ~8.004 B/param for a transformer layer; ``host_bytes_per_param`` reports the exact figure
from what was allocated.  With an fp32 load buffer (CPU tests) that buffer is the master.

Why sqrt(v): the update needs sqrt(v) anyway (decode, square, EMA, sqrt: one multiply more than
storing v), and the square root halves the log-range, so 16 binades of the code cover 32 binades
of v at 1/32 relative precision.  Why a per-block absmax: one outlier only affects its block of
``block_size`` elements.  Bias correction is applied once, in the step size and the denominator
(``lr / (1 - b1^t)`` and ``sqrt(v) / sqrt(1 - b2^t) + eps``), exactly as ``torch.optim.AdamW``;
weight decay is decoupled (``p *= 1 - lr * wd`` before the Adam step).

Speed: two implementations of the same update.  The default is the one-pass C kernel of
``ckernel.py`` (built on first use with the system compiler): each of ``num_threads`` pool workers
makes one GIL-free call for a contiguous run of chunks, and every element is read and written once
(~14 bytes of memory traffic per parameter, against ~28 for fp32 AdamW).  Where no compiler is
available (or ``kernel=False``) the torch path runs the same math as ~35 vectorized ops per chunk of
``chunk_numel`` elements, into per-thread scratch buffers (no per-op allocations), on the same
thread pool; chunks stay below torch's 32768-element grain so no op starts torch's OpenMP team
inside a worker (nested, spinning OpenMP threads made it 10x slower on a busy machine).  It is
~10x slower than the kernel.  Measured rates: benchmarks/optim_rate.py.
``step`` holds a per-block lock and only touches that block's state, so concurrent calls for
different blocks are safe.

GPU-resident blocks (a load buffer on a CUDA device, see ``base.py``): the state (``lo``, codes,
absmax, small-tensor moments) lives on that device and ``step`` launches the Triton kernels of
``triton_kernel.py`` on the current stream, without any host synchronisation: the same update, bit
for bit, as the C kernel.  Without Triton the torch path runs on the device tensors instead (large
chunks, stream-ordered scratch from the caching allocator; ~35 launches per chunk, slow: a warning
is logged once).  Both device paths decode in the two-multiplication form, which needs no host read
of the global absmax maximum (see ``triton_kernel.py`` for why it gives the same bits).
``master`` and ``state_tensors`` return CPU tensors, so checkpoints do not depend on placement.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ...ir import PlanError
from ..manifest import CheckpointError
from . import ckernel
from . import quant as Q
from . import quant4 as Q4
from . import triton_kernel as TK
from .base import HostOptimizer, Segment
from .sr import round_sr_, sr_key
from .streamed import Streamed8bit, device_tables

log = logging.getLogger(__name__)
_TWO_112 = 2.0**112
#: why a stochastic-rounding master refuses GPU-resident blocks (``setup``) and GPU-updated ones (``streamed.py``)
NO_DEVICE_SR = ("the stochastic-rounding master (optimizer hybrid8bit-sr) updates on the host only: compile the plan "
                "with resident='none' and gpu_update='none' (the compiler does for optimizer='hybrid8bit-sr')")
#: why 4-bit moments refuse GPU-resident blocks (``setup``) and GPU-updated ones (``streamed.py``)
NO_DEVICE_4BIT = ("4-bit moments (optimizer hybrid4bit or hybrid4bit-sr) update on the host only: compile the plan "
                  "with resident='none' and gpu_update='none' (the compiler does for optimizer='hybrid4bit')")
#: the quantization block of each moment width when none is given: 4-bit codes need short blocks (``quant4.py``)
DEFAULT_BLOCK = {8: 2048, 4: 128}
#: device blocks' state tensors beyond the load buffer (what ``device_bytes_per_param`` counts)
_DEVICE_STATE = ("lo", "own_master", "mq", "vq", "m_absmax", "v_absmax", "m32", "v32", "table", "small_index")


class _BlockState:
    def __init__(self):
        self.lock = threading.Lock()
        self.step = 0
        self.device = False  # a GPU-resident block: state on the load buffer's device
        self.sr = False  # the master is the bf16 load buffer alone, rounded stochastically
        self.block = 0
        self.table = self.small_index = None  # device blocks: the Triton kernels' index tables


def _split_master_(p: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Write fp32 ``p`` as round-to-nearest bf16 ``hi`` (int16 view) and the int16 remainder ``lo``."""
    bits = p.view(torch.int32)
    lo.copy_(bits)  # int32 -> int16 keeps the low 16 bits (two's complement wrap)
    t = bits.add(0x8000)
    t.bitwise_right_shift_(16)
    hi.copy_(t)


def _join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    bits = hi.to(torch.int32)
    bits.bitwise_left_shift_(16)
    bits.add_(lo)
    return bits.view(torch.float32)


class Hybrid8bitAdamW(Streamed8bit, HostOptimizer):
    """AdamW with block-wise 8-bit moments; see the module docstring for the format and memory."""

    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        block_size: int | None = None,
        min_8bit_numel: int = 4096,
        chunk_numel: int = 16384,
        num_threads: int | None = None,
        kernel: bool | None = None,
        stochastic_rounding: bool = False,
        seed: int = 0,
        moment_bits: int = 8,
    ):
        if moment_bits not in DEFAULT_BLOCK:
            raise ValueError(f"moment_bits must be 8 or 4, got {moment_bits!r}")
        #: the width of the moments' codes: 8 (``quant.py``) or 4 (``quant4.py``: two a byte, host updates only)
        self.moment_bits = moment_bits
        block_size = DEFAULT_BLOCK[moment_bits] if block_size is None else block_size
        if moment_bits == 4 and block_size % 2:
            raise ValueError(f"block_size must be even with 4-bit moments (two codes a byte), got {block_size}")
        if block_size <= 0 or chunk_numel % block_size:
            raise ValueError(f"chunk_numel ({chunk_numel}) must be a multiple of block_size ({block_size})")
        #: a bf16 load buffer is the whole master, rounded stochastically (``sr.py``): no low half (-2 B/param)
        self.stochastic_rounding, self.seed = bool(stochastic_rounding), int(seed)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.max_grad_norm = max_grad_norm
        self.block_size, self.min_8bit_numel, self.chunk_numel = block_size, min_8bit_numel, chunk_numel
        self.num_threads = num_threads or torch.get_num_threads() or os.cpu_count() or 1
        self._blocks: dict[int, _BlockState] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        self._pool_lock = threading.Lock()
        self._grad_bytes = 2
        self._tls = threading.local()
        # the compiled one-pass kernel (ckernel.py) when it builds here; kernel=False forces the torch path
        self._lib = None
        if kernel is not False and block_size <= 4096:
            self._lib = ckernel.load()
        if kernel and self._lib is None:
            raise RuntimeError(
                "Hybrid8bitAdamW(kernel=True): the C kernel could not be built (is a C compiler installed?)"
            )
        # device blocks: chunk of the torch fallback (large: each op is a launch), and test hooks --
        # _force_device treats CPU load buffers as device blocks, _no_triton forces the fallback
        self._dev_chunk = max(block_size, (1 << 20) // block_size * block_size)
        self._force_device = False
        self._no_triton = False
        self._warned_slow = False

    @property
    def host_only(self) -> bool:
        """No device path: the stochastic-rounding master and the 4-bit moments update on the host only."""
        return self.stochastic_rounding or self.moment_bits == 4

    def _no_device(self) -> str:
        """Why a device block is refused (``host_only``), naming the fix."""
        return NO_DEVICE_4BIT if self.moment_bits == 4 else NO_DEVICE_SR

    # -- memory --------------------------------------------------------------------------------------
    @property
    def host_bytes_per_param(self) -> float:
        """Host memory per parameter of the host-resident blocks (device blocks keep none)."""
        host = [st for st in self._blocks.values() if not st.device]
        if not host:  # estimate for an all-quantized block with bf16 buffers
            return 2 + 2 + (0 if self.stochastic_rounding else 2) + self.moment_bits / 4 + 8 / self.block_size
        numel = total = 0
        for st in host:
            numel += st.load.numel()
            total += st.load.numel() * (st.load.element_size() + self._grad_bytes)
            for name in ("lo", "own_master", "mq", "vq", "m_absmax", "v_absmax", "m32", "v32"):
                t = getattr(st, name)
                if t is not None:
                    total += t.numel() * t.element_size()
        return total / numel

    def device_bytes_per_param(self, param_bytes: int | None = None) -> float:
        """Device memory per parameter that the optimizer keeps for a GPU-resident block beyond its
        load buffer (the compiler budgets GPU memory with it).

        With ``param_bytes`` (the load buffer's element size; 2 is taken as bf16) or before any
        device block is set up: the figure for an all-8-bit block whose segments are multiples of
        ``block_size``, exact for that case: ``lo`` (2 B with a bf16 buffer, 0 with fp32) + two
        1-byte codes + per quantization block two fp32 absmax and a 24-byte kernel table entry.
        Small segments cost more (fp32 m and v + an 8-byte index: 16 B each) and a short last block
        a whole table entry: a slight underestimate for real blocks, which the measured figure
        (no argument, after ``setup``) includes.  The torch fallback's transient scratch (5 x 4 B x
        ``_dev_chunk`` per step, from the caching allocator) is not counted.  The stochastic-rounding master
        has no device path, nor have 4-bit moments: they raise, as ``HostOptimizer``'s does."""
        if self.host_only:
            raise NotImplementedError(self._no_device())
        dev = [st for st in self._blocks.values() if st.device]
        if param_bytes is not None or not dev:
            master = 0 if param_bytes == 4 else 2
            return master + 2 + (8 + 24) / self.block_size
        numel = total = 0
        for st in dev:
            numel += st.load.numel()
            for name in _DEVICE_STATE:
                t = getattr(st, name)
                if t is not None:
                    total += t.numel() * t.element_size()
        return total / numel

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self, block: int, init: torch.Tensor, load_buffer: torch.Tensor, segments: list[Segment]) -> None:
        dev = load_buffer.device
        n = load_buffer.numel()
        st = _BlockState()
        st.device = dev.type != "cpu" or self._force_device
        st.block = block
        if st.device and self.host_only:
            raise PlanError(f"{self._no_device()} (block {block} is GPU-resident)")
        init = init.reshape(-1).to(device=dev, dtype=torch.float32)
        st.load = load_buffer
        st.lo = st.own_master = None
        if load_buffer.dtype == torch.float32:
            if init.data_ptr() != load_buffer.data_ptr():
                load_buffer.copy_(init)
        elif load_buffer.dtype == torch.bfloat16 and self.stochastic_rounding:
            st.sr = True  # the initial master rounded to nearest: deterministic, and exact for bf16 weights
            load_buffer.copy_(init)
        elif load_buffer.dtype == torch.bfloat16:
            st.lo = torch.empty(n, dtype=torch.int16, device=dev)
            _split_master_(init, load_buffer.view(torch.int16), st.lo)
        else:  # e.g. fp16 load buffer: keep a plain fp32 master
            st.own_master = init.clone()
            load_buffer.copy_(init)
        if not segments:
            segments = [("flat", 0, n, (n,))]
        # 8-bit work items (off, numel, rows, qoff, soff) and fp32 ranges (off, numel, soff32)
        st.items, st.small = [], []
        q = s = s32 = 0
        bs = self.block_size
        ch = self._dev_chunk if st.device else self.chunk_numel
        for _name, off, numel, shape in sorted(segments, key=lambda x: x[1]):
            # a tensor is small by its whole size: a rank's piece of a large one (``ir.sharding``) stays 8-bit
            if max(numel, math.prod(shape)) < self.min_8bit_numel:
                st.small.append((off, numel, s32))
                s32 += numel
                continue
            full = numel // bs * bs
            for a in range(0, full, ch):
                k = min(ch, full - a)
                st.items.append((off + a, k, k // bs, q + a, s + a // bs))
            if numel > full:  # a last, shorter quantization block
                st.items.append((off + full, numel - full, 1, q + full, s + full // bs))
            q += numel + (numel & 1 if self.moment_bits == 4 else 0)  # 4-bit: a tensor's codes start at a byte
            s += -(-numel // bs)
        st.items_tensor = torch.tensor(st.items, dtype=torch.int64).reshape(-1, 5)
        nq = q // 2 if self.moment_bits == 4 else q
        st.mq = torch.zeros(nq, dtype=torch.uint8, device=dev)
        st.vq = torch.zeros(nq, dtype=torch.uint8, device=dev)
        st.m_absmax, st.v_absmax = torch.zeros(s, device=dev), torch.zeros(s, device=dev)
        st.m32, st.v32 = torch.zeros(s32, device=dev), torch.zeros(s32, device=dev)
        if st.device:
            st.table, st.small_index = device_tables(st, bs, dev)
        self._blocks[block] = st

    # -- master access -------------------------------------------------------------------------------
    def _get(self, st, off: int, n: int) -> torch.Tensor:
        if st.lo is not None:
            return _join_master(st.load.view(torch.int16)[off : off + n], st.lo[off : off + n])
        if st.sr:
            return st.load[off : off + n].to(torch.float32)
        if st.own_master is not None:
            return st.own_master[off : off + n]
        return st.load[off : off + n]

    def _put(self, st, off: int, n: int, p: torch.Tensor, key: int = 0) -> None:
        if st.lo is not None:
            _split_master_(p, st.load.view(torch.int16)[off : off + n], st.lo[off : off + n])
        elif st.sr:
            round_sr_(p, st.load.view(torch.int16)[off : off + n], off, key)
        elif st.own_master is not None:
            st.load[off : off + n].copy_(p)

    @staticmethod
    def _sync(st) -> None:
        """Wait for a CUDA block's queued work (any stream): checkpoint access runs between steps."""
        if st.load.is_cuda:
            torch.cuda.synchronize(st.load.device)

    def master(self, block: int) -> torch.Tensor:
        """A CPU copy of the fp32 master (device blocks too)."""
        st = self._blocks[block]
        self._sync(st)
        return self._get(st, 0, st.load.numel()).to("cpu", copy=True)

    # -- the update ----------------------------------------------------------------------------------
    def _pool_map(self, fn, items) -> None:
        """Run ``fn`` over ``items``: the calling thread takes the last one, ``num_threads - 1``
        pool workers the others (so ``num_threads`` threads are busy in all)."""
        if self.num_threads <= 1 or len(items) <= 1:
            for it in items:
                fn(it)
            return
        with self._pool_lock:
            # num_threads may grow between steps (train's thread tuner): a bigger pool replaces the old
            # one, which is left to finish what another update thread may still be submitting to it
            if self._pool is None or self._pool_workers < self.num_threads - 1:
                self._pool_workers = self.num_threads - 1
                self._pool = ThreadPoolExecutor(self._pool_workers, thread_name_prefix="lazytrain-optim")
            pool = self._pool
        futures = [pool.submit(fn, it) for it in items[:-1]]
        fn(items[-1])
        for f in futures:
            f.result()

    def step(self, block: int, grad: torch.Tensor, clip_coef: float = 1.0, lr: float | None = None) -> None:
        st = self._blocks[block]
        with st.lock:
            st.step += 1
            self._update(st, st.step, grad, clip_coef, lr)

    def _update(self, st, t: int, grad: torch.Tensor, clip_coef: float, lr: float | None) -> None:
        """Step ``t`` of the block whose tensors ``st`` holds (its own, or a streamed block's device copies)."""
        lr = self.lr if lr is None else lr
        grad = grad.reshape(-1)
        self._grad_bytes = grad.element_size()
        b1, b2 = self.betas
        c = dict(
            b1=b1,
            b2=b2,
            sqrt_b2=math.sqrt(b2),
            gm=(1 - b1) * clip_coef,
            gv=(1 - b2) * clip_coef * clip_coef,
            decay=1 - lr * self.weight_decay,
            inv_bc2_sqrt=1 / math.sqrt(1 - b2**t),
            step_size=-lr / (1 - b1**t),
            eps=self.eps,
            key=sr_key(self.seed, st.block, t),
        )
        if st.device:
            self._step_device(st, grad, c)
            return
        use_c = self._lib is not None and st.own_master is None and grad.dtype in (torch.bfloat16, torch.float32)
        hp_key = ctypes.c_uint32(c["key"])
        if use_c:  # no torch op over the whole block here: it could wake torch's spinning OpenMP team
            m_max = self._lib.hybrid8_max(st.m_absmax.data_ptr(), st.m_absmax.numel())
            v_max = self._lib.hybrid8_max(st.v_absmax.data_ptr(), st.v_absmax.numel())
        else:
            m_max, v_max = st.m_absmax, st.v_absmax
        code = Q4 if self.moment_bits == 4 else Q
        m_ratio, c["m_pre"] = Q.decode_ratio(m_max, code.SIGNED_TOP, b1)
        v_ratio, c["v_pre"] = Q.decode_ratio(v_max, code.UNSIGNED_TOP, math.sqrt(b2))
        if use_c:
            keys = ("gm", "gv", "decay", "inv_bc2_sqrt", "step_size", "eps", "m_pre", "v_pre")
            hp = (ctypes.c_float * 12)(*[c[k] for k in keys], m_ratio, v_ratio, b1, b2)
            grad = grad.contiguous()
            items = st.items_tensor
            k = max(1, -(-items.shape[0] // self.num_threads))  # one contiguous run per worker
            runs = [items[i : i + k] for i in range(0, items.shape[0], k)]
            self._pool_map(lambda run: self._run_c(st, grad, run, hp, hp_key), runs)
        else:
            c["m_dec"], c["v_dec"] = st.m_absmax * m_ratio, st.v_absmax * v_ratio
            k = max(1, -(-len(st.items) // self.num_threads))  # one contiguous run per worker
            runs = [st.items[i : i + k] for i in range(0, len(st.items), k)]
            self._pool_map(lambda run: [self._chunk8(st, grad, it, c) for it in run], runs)
        for off, n, s32 in st.small:
            if use_c:
                self._small_c(st, grad, off, n, s32, hp, hp_key)
            else:
                self._small(st, grad, off, n, s32, c)

    def _step_device(self, st, grad: torch.Tensor, c: dict) -> None:
        """The update of a GPU-resident block, queued on the current stream: no host synchronisation
        (every input is a python float or a device tensor; nothing branches on device values)."""
        dev = st.load.device
        hilo = st.lo is not None
        if not self._no_triton and TK.usable_for(dev):
            hi = st.load.view(torch.int16) if hilo else None
            p32 = None if hilo else (st.own_master if st.own_master is not None else st.load)
            grad = grad.contiguous()
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                TK.hybrid8_step(
                    st.table, self.block_size, grad, hi, st.lo, p32, st.mq, st.vq, st.m_absmax, st.v_absmax, c
                )
                TK.adamw32_step(st.small_index, grad, hi, st.lo, p32, st.m32, st.v32, c)
            if st.own_master is not None:
                st.load.copy_(st.own_master)
            return
        if not self._warned_slow:
            self._warned_slow = True
            log.warning(
                "Hybrid8bitAdamW: Triton is not available for %s; GPU-resident blocks use the torch path "
                "(~35 launches per %d-element chunk, several times slower than the kernel)",
                dev,
                self._dev_chunk,
            )
        # the two-multiplication decode, always: no read of the global absmax max to the host
        c["m_pre"] = c["v_pre"] = _TWO_112
        c["m_dec"] = st.m_absmax * (c["b1"] / (Q.SIGNED_TOP * _TWO_112))
        c["v_dec"] = st.v_absmax * (c["sqrt_b2"] / (Q.UNSIGNED_TOP * _TWO_112))
        # allocated on the current stream, so the caching allocator orders their reuse with this work
        bufs = [torch.empty(self._dev_chunk, dtype=torch.int32, device=dev) for _ in range(5)]
        for it in st.items:
            self._chunk8(st, grad, it, c, bufs)
        for off, n, s32 in st.small:
            self._small(st, grad, off, n, s32, c)

    def _scratch(self) -> list[torch.Tensor]:
        """Five chunk-sized int32 buffers per thread, reused across steps: fresh multi-hundred-KB
        temporaries per op would cost page faults on every chunk."""
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = [torch.empty(self.chunk_numel, dtype=torch.int32) for _ in range(5)]
        return bufs

    def _run_c(self, st, grad, items: torch.Tensor, hp, key) -> None:
        """One C call for a run of chunks: the GIL is released once, for the whole run."""
        lo, hi = st.lo is not None, st.lo is not None or st.sr  # the bf16 buffer: high half, or all (sr)
        rc = (self._lib.hybrid4_run if self.moment_bits == 4 else self._lib.hybrid8_run)(
            items.shape[0],
            items.data_ptr(),
            grad.data_ptr(),
            int(grad.dtype == torch.bfloat16),
            st.load.data_ptr() if hi else None,
            st.lo.data_ptr() if lo else None,
            None if hi else st.load.data_ptr(),
            st.mq.data_ptr(),
            st.vq.data_ptr(),
            st.m_absmax.data_ptr(),
            st.v_absmax.data_ptr(),
            hp,
            key,
        )
        if rc:
            raise RuntimeError(f"hybrid{self.moment_bits} kernel failed ({rc})")

    def _chunk8(self, st, grad, item, c, bufs: list[torch.Tensor] | None = None) -> None:
        off, n, rows, qoff, soff = item
        f32 = torch.float32
        raw = bufs if bufs is not None else self._scratch()
        G, M, S, P, T = (b[:n].view(rows, -1) for b in raw)
        g = G.view(f32)
        g.copy_(grad[off : off + n].view(rows, -1))
        m_am, v_am = st.m_absmax[soff : soff + rows], st.v_absmax[soff : soff + rows]
        m_dec, v_dec = c["m_dec"][soff : soff + rows, None], c["v_dec"][soff : soff + rows, None]
        if self.moment_bits == 4:  # unpacked into the scratch (a short last block may take n + 1 of it)
            mq, vq = (t[qoff // 2 : qoff // 2 + Q4.packed_bytes(n)] for t in (st.mq, st.vq))
            m = Q4.decode_signed(Q4.unpack(mq, n, out=raw[1]).view(rows, -1), m_dec, c["m_pre"], tmp=T)  # b1 * m
            s = Q4.decode_unsigned(Q4.unpack(vq, n, out=raw[2]).view(rows, -1), v_dec, c["v_pre"])  # sqrt(b2 * v)
        else:
            mq, vq = st.mq[qoff : qoff + n].view(rows, -1), st.vq[qoff : qoff + n].view(rows, -1)
            m = Q.decode_signed(mq, m_dec, c["m_pre"], out=M, tmp=T)  # b1 * m
            s = Q.decode_unsigned(vq, v_dec, c["v_pre"], out=S)  # sqrt(b2 * v)
        m.add_(g, alpha=c["gm"])
        s.mul_(s)
        s.addcmul_(g, g, value=c["gv"])
        s.sqrt_()
        if st.lo is not None:
            hi, lo = st.load.view(torch.int16)[off : off + n].view(rows, -1), st.lo[off : off + n].view(rows, -1)
            P.copy_(hi)
            P.bitwise_left_shift_(16)
            P.add_(lo)
            p = P.view(f32)
        elif st.sr:
            P.copy_(st.load.view(torch.int16)[off : off + n].view(rows, -1))
            P.bitwise_left_shift_(16)
            p = P.view(f32)
        else:
            p = self._get(st, off, n).view(rows, -1)
        if c["decay"] != 1.0:
            p.mul_(c["decay"])
        denom = torch.mul(s, c["inv_bc2_sqrt"], out=G.view(f32))  # the gradient is no longer needed
        denom.add_(c["eps"])
        p.addcdiv_(m, denom, value=c["step_size"])
        if st.lo is not None:
            lo.copy_(P)
            torch.add(P, 0x8000, out=T)
            T.bitwise_right_shift_(16)
            hi.copy_(T)
        else:
            self._put(st, off, n, p.view(-1), c["key"])
        torch.maximum(m.amax(dim=1), m.amin(dim=1).neg_(), out=m_am)
        torch.amax(s, dim=1, out=v_am)
        if self.moment_bits == 4:
            Q4.pack_(Q4.encode_signed(m, Q.encode_factor(m_am, Q4.SIGNED_TOP)[:, None], tmp=T).view(-1), mq)
            Q4.pack_(Q4.encode_unsigned(s, Q.encode_factor(v_am, Q4.UNSIGNED_TOP)[:, None]).view(-1), vq)
            return
        Q.encode_signed_(m, Q.encode_factor(m_am, Q.SIGNED_TOP)[:, None], mq, tmp=T)
        Q.encode_unsigned_(s, Q.encode_factor(v_am, Q.UNSIGNED_TOP)[:, None], vq)

    def _small_c(self, st, grad, off, n, s32, hp, key) -> None:
        lo, hi = st.lo is not None, st.lo is not None or st.sr
        el = grad.element_size()
        self._lib.adamw32_range(
            n,
            grad.data_ptr() + off * el,
            int(grad.dtype == torch.bfloat16),
            st.load.data_ptr() + off * 2 if hi else None,
            st.lo.data_ptr() + off * 2 if lo else None,
            None if hi else st.load.data_ptr() + off * 4,
            st.m32.data_ptr() + s32 * 4,
            st.v32.data_ptr() + s32 * 4,
            hp,
            key,
            off,
        )

    def _small(self, st, grad, off, n, s32, c) -> None:
        g = grad[off : off + n].to(torch.float32)
        m, v = st.m32[s32 : s32 + n], st.v32[s32 : s32 + n]
        m.mul_(c["b1"]).add_(g, alpha=c["gm"])
        v.mul_(c["b2"]).addcmul_(g, g, value=c["gv"])
        p = self._get(st, off, n)
        if c["decay"] != 1.0:
            p.mul_(c["decay"])
        denom = v.sqrt().mul_(c["inv_bc2_sqrt"]).add_(c["eps"])
        p.addcdiv_(m, denom, value=c["step_size"])
        self._put(st, off, n, p, c["key"])

    # -- checkpoints ---------------------------------------------------------------------------------
    _STATE = ("mq", "vq", "m_absmax", "v_absmax", "m32", "v32")

    def state_tensors(self, block: int) -> dict[str, torch.Tensor]:
        st = self._blocks[block]
        with st.lock:
            self._sync(st)
            out = {k: getattr(st, k).to("cpu", copy=True) for k in self._STATE}  # CPU, whatever the placement
            out["master"] = self.master(block)
            out["step"] = torch.tensor([st.step], dtype=torch.int64)
        return out

    def load_state_tensors(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        st = self._blocks[block]
        with st.lock:
            for k in self._STATE:
                have, given = getattr(st, k), tensors[k]
                if given.shape != have.shape:  # (copy_ would broadcast a 1-element tensor)
                    raise ValueError(f"state {k} has shape {list(given.shape)}, this optimizer's layout "
                                     f"({self.moment_bits}-bit moments, block_size {self.block_size}) holds "
                                     f"{list(have.shape)}")
                have.copy_(given)
            n = st.load.numel()
            master = tensors["master"].to(device=st.load.device, dtype=torch.float32).reshape(-1)
            if st.lo is not None:
                _split_master_(master.contiguous(), st.load.view(torch.int16), st.lo)
            elif st.sr:  # a split master's low half is dropped: rounded to nearest, as at setup
                st.load.copy_(master)
            else:
                (st.own_master if st.own_master is not None else st.load).copy_(master)
                st.load.copy_(master[:n])
            st.step = int(tensors["step"].reshape(-1)[0])
            self._sync(st)  # the next step may run on another stream

    def hyperparameters(self) -> dict:
        return {
            "name": "Hybrid8bitAdamW",
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "block_size": self.block_size,
            "min_8bit_numel": self.min_8bit_numel,
            "stochastic_rounding": self.stochastic_rounding,
            "seed": self.seed,
            "moment_bits": self.moment_bits,
            "step": max((st.step for st in self._blocks.values()), default=0),
        }

    def load_hyperparameters(self, hp: dict) -> None:
        """Restore ``hp``; a state of the other moment width is refused (its codes do not convert: the checkpoint
        loader checks the shapes only after this)."""
        bits = hp.get("moment_bits", 8)  # (saved before 4-bit moments existed: 8)
        if bits != self.moment_bits:
            raise CheckpointError(f"the checkpoint's optimizer state has {bits}-bit moments, this optimizer "
                                  f"{self.moment_bits}-bit ones: resume with --optimizer "
                                  f"{'hybrid4bit' if bits == 4 else 'hybrid8bit'} (or -sr), or start a new run")
        self.lr = hp.get("lr", self.lr)
        self.betas = tuple(hp.get("betas", self.betas))
        self.eps = hp.get("eps", self.eps)
        self.weight_decay = hp.get("weight_decay", self.weight_decay)
        self.max_grad_norm = hp.get("max_grad_norm", self.max_grad_norm)
