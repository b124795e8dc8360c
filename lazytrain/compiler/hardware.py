"""Hardware profiles: the figures the cost model turns FLOPs and bytes into seconds with.

A ``HardwareProfile`` is a frozen record of one machine (one GPU and its share of the host).
Built-ins live in ``profiles.PROFILES``; ``lazytrain profile -o hw.json`` measures the real machine
(``lazytrain.measure.profile.measure``) and ``profiles.get_profile`` reads either.  ``lazytrain profile --model M`` (or
``compile(..., calibrate=True)``) adds ``calibration``: measured times of that model's own block
programs (``BlockTiming``, ``lazytrain/measure/calibrate.py``), which the cost model uses instead of the
figures below for every block they match.

Units: bandwidths in GB/s with GB = 1e9 bytes (as ``nvidia-smi``, PCIe specs and disk vendors
write them), compute in TFLOP/s (1e12), optimizer rates in G params/s (1e9), memory in bytes.

How compute time is modelled (the cost pass must count FLOPs the same way; ``layer_flops`` and
``attention_flops`` write the formulas down, ``frontend.attention`` counts them in the trace):

- A transformer layer's forward is ``2 * params * tokens`` of matmuls (every weight multiplies every
  token once; backward twice that) plus attention, ``4 * batch * seq**2 * hidden`` for full attention and
  **half that** for causal attention (the fused kernels skip the masked half; ``hidden`` is ``n_heads *
  head_dim`` of the queries); its backward is 2.5x its forward (the kernel recomputes the scores).
- One eager launch of a block (one block, one micro-batch, forward or backward) takes
  ``matmul_flops / (bf16_tflops * 1e12 * compute_efficiency) + attention_seconds + kernel_overhead_s``
  (``block_seconds``), but no less than its ops times ``op_dispatch_s`` (forward) or ``op_dispatch_bwd_s``
  (backward): Python issues every op, so small blocks (short sequences, small micro-batches) are
  dispatch bound.
- Attention runs at its own rate (``attention_seconds``): ``attn_fwd_tflops`` / ``attn_bwd_tflops`` at
  long keys and head dimension 128, times ``kv_len / (kv_len + attn_half_len)`` (short keys pay the
  diagonal tiles and the launch), times a head-dimension factor (``ATTENTION_HEAD_DIM_FACTOR``).  A profile
  without these figures (0, older files) prices attention like the rest of the block.

The built-in profiles, and where each figure comes from, are ``profiles.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .block_timing import BlockTiming
from .flops import ATTENTION_HEAD_DIM_FACTOR, attention_flops, head_dim_factor, layer_flops

__all__ = ["HardwareProfile", "layer_flops", "attention_flops", "head_dim_factor",
           "ATTENTION_HEAD_DIM_FACTOR", "FORMAT", "VERSION"]

FORMAT = "lazytrain.hardware"
VERSION = 1
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One GPU and its share of the host. See the module docstring for units and the compute model."""

    name: str
    gpu_name: str
    gpu_memory_bytes: int
    host_memory_bytes: int
    cpu_cores: int
    bf16_tflops: float          # dense bf16 matmul rate reached by big GEMMs
    compute_efficiency: float   # fraction of bf16_tflops an eager transformer block reaches
    kernel_overhead_s: float    # fixed cost of one block launch (one block, one micro-batch)
    h2d_gbps: float             # pinned host -> GPU
    d2h_gbps: float             # pinned GPU -> host
    duplex_gbps: float          # both directions at once, the sum of the two
    pageable_h2d_gbps: float
    pageable_d2h_gbps: float
    cpu_adam_gparams: float     # fused fp32 AdamW on all host cores
    cpu_adam8_gparams: float    # 8-bit AdamW on all host cores
    nvme_read_gbps: float
    nvme_write_gbps: float
    source: str                 # where the figures come from
    #: CPU time to issue one op of a block's forward (fx + autograd recording + saved-tensor hooks), and
    #: its backward per forward op: the floor under a block's time when its kernels are too small to
    #: keep the GPU ahead of Python (0: not modelled; older profile files lack them)
    op_dispatch_s: float = 0.0
    op_dispatch_bwd_s: float = 0.0
    #: fused causal attention at long keys and head dim 128, forward and backward (FLOPs counted as the
    #: kernel does them), and the key length at which it reaches half that (0: priced like the block)
    attn_fwd_tflops: float = 0.0
    attn_bwd_tflops: float = 0.0
    attn_half_len: float = 0.0
    #: collectives between the GPUs of one host (bus bandwidth of a ring all-gather / reduce-scatter, GB/s,
    #: and latency per ring step) and between hosts (per GPU); defaults: PCIe-class peer copies and 100 Gb/s
    #: Ethernet, modelled (``lazytrain profile`` measures the first two when several GPUs are visible)
    collective_gbps: float = 20.0
    collective_latency_s: float = 20e-6
    internode_gbps: float = 12.5
    internode_latency_s: float = 20e-6
    #: the model's own state over PCIe as a step runs it, GB/s (0: the pinned ``h2d_gbps`` / ``d2h_gbps``):
    #: parameter loads and GPU-updated blocks' state loads, gradient offloads and state stores.  In a host-paced
    #: step they share the host's memory with the optimizer's updates and run slower than the copy benchmark;
    #: ``lazytrain.measure.step_rates`` measures them in a plan's own step
    param_load_gbps: float = 0.0
    grad_offload_gbps: float = 0.0
    #: measured blocks' forwards, and backwards (with the recompute inside them), as a training step runs them over
    #: the calibration's timing steps (1: as calibrated): a step holds the GPU busy for seconds, under its power
    #: limit, where a short timing step may start at boost clocks [ledger: calibrate-sustain].
    #: ``lazytrain.measure.step_rates`` measures them in a plan's own step
    step_forward_scale: float = 1.0
    step_backward_scale: float = 1.0
    #: the NVMe tier's disk reading and writing at once, GB/s of both together (0: unknown, ``nvme_mixed_gbps``
    #: takes the faster direction alone); the requests in flight and the bytes of one request the three disk rates
    #: were measured at, as the runtime issues them (``runtime/nvme.py``; 0: unknown)
    nvme_both_gbps: float = 0.0
    nvme_queue_depth: int = 0
    nvme_request_bytes: int = 0
    #: a quantized frozen base's dequantization on the device (``runtime/quantized.py``), GB/s of dequantized output
    #: (parameter-dtype bytes written): 4-bit NF4 and 8-bit int8.  The built-ins estimate them from HBM bandwidth
    #: (``profiles.dequant_estimate``) until ``lazytrain profile`` measures them; these defaults, for files written
    #: before the fields, are an RTX 3090's estimates
    dequant_gbps: float = 140.0
    dequant8_gbps: float = 500.0
    #: measured block programs (``BlockTiming``); the cost model prefers them to the figures above
    calibration: tuple = ()

    def __post_init__(self) -> None:
        if not isinstance(self.calibration, tuple) or not all(isinstance(t, BlockTiming) for t in self.calibration):
            raise ValueError("hardware profile field calibration must be a tuple of BlockTiming")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "calibration":
                continue
            if field.type == "str":
                if not isinstance(value, str):
                    raise ValueError(f"hardware profile field {field.name} must be text, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"hardware profile field {field.name} must be a number, got {value!r}")
            if field.type == "int" and not isinstance(value, int):
                raise ValueError(f"hardware profile field {field.name} must be a whole number, got {value!r}")
            if field.name in ("kernel_overhead_s", "op_dispatch_s", "op_dispatch_bwd_s", "attn_fwd_tflops",
                              "attn_bwd_tflops", "attn_half_len", "param_load_gbps", "grad_offload_gbps",
                              "nvme_both_gbps", "nvme_queue_depth", "nvme_request_bytes"):
                ok = value >= 0
            else:
                ok = value > 0
            if not ok or value != value or value == float("inf"):
                raise ValueError(f"hardware profile field {field.name} must be positive, got {value!r}")
        if self.compute_efficiency > 1:
            raise ValueError(f"compute_efficiency is a fraction of bf16_tflops, got {self.compute_efficiency}")

    #: ``gpu_name`` of a profile whose "GPU" is the host itself (CPU mode)
    NO_GPU = "CPU (no GPU)"

    @property
    def has_gpu(self) -> bool:
        """False for CPU mode, where device work and host work share the same cores."""
        return self.gpu_name != self.NO_GPU

    # --- times -------------------------------------------------------------------------------
    def matmul_seconds(self, flops: float) -> float:
        """A big dense bf16 matmul at the peak rate ``bf16_tflops``."""
        return flops / (self.bf16_tflops * 1e12)

    def block_seconds(self, flops: float, launches: int = 1, ops: int = 0, backward: bool = False,
                      attn_flops: float = 0.0, head_dim: int = 128, kv_len: int = 0) -> float:
        """Eager transformer work: ``flops`` at ``compute_efficiency`` plus ``launches`` fixed overheads,
        but never less than issuing the block's ``ops`` from Python: kernels run asynchronously, so a
        block is as slow as the slower of its kernels and its dispatch (small micro-batches, short
        sequences, narrow layers are dispatch bound).  ``attn_flops`` of ``flops`` are fused attention,
        priced by ``attention_seconds``."""
        matmul = flops - attn_flops
        kernels = (matmul / (self.bf16_tflops * 1e12 * self.compute_efficiency)
                   + self.attention_seconds(attn_flops, head_dim, kv_len, backward) + launches * self.kernel_overhead_s)
        return max(kernels, ops * (self.op_dispatch_bwd_s if backward else self.op_dispatch_s))

    def attention_rate(self, head_dim: int, kv_len: int, backward: bool = False) -> float:
        """TFLOP/s of fused causal attention over ``kv_len`` keys (module docstring); 0 if not modelled."""
        peak = self.attn_bwd_tflops if backward else self.attn_fwd_tflops
        if not peak or kv_len <= 0:
            return 0.0
        return peak * head_dim_factor(head_dim, backward) * kv_len / (kv_len + self.attn_half_len)

    def attention_seconds(self, flops: float, head_dim: int, kv_len: int, backward: bool = False) -> float:
        """Fused attention of ``flops``; at the block rate where the profile has no attention figures."""
        if not flops:
            return 0.0
        rate = self.attention_rate(head_dim, kv_len, backward)
        return flops / ((rate or self.bf16_tflops * self.compute_efficiency) * 1e12)

    def measured(self, signature: str, micro_batch: int) -> BlockTiming | None:
        """The measured timing of a block with this signature at this micro-batch, if there is one."""
        for t in self.calibration:
            if t.signature == signature and t.micro_batch == micro_batch:
                return t
        return None

    def with_timings(self, timings) -> HardwareProfile:
        """This profile with ``timings`` added (replacing any of the same block and micro-batch)."""
        new = {(t.signature, t.micro_batch): t for t in timings}
        kept = tuple(t for t in self.calibration if (t.signature, t.micro_batch) not in new)
        return dataclasses.replace(self, calibration=kept + tuple(new.values()))

    def h2d_seconds(self, nbytes: float, *, pinned: bool = True) -> float:
        return nbytes / ((self.h2d_gbps if pinned else self.pageable_h2d_gbps) * 1e9)

    def d2h_seconds(self, nbytes: float, *, pinned: bool = True) -> float:
        return nbytes / ((self.d2h_gbps if pinned else self.pageable_d2h_gbps) * 1e9)

    def param_load_seconds(self, nbytes: float) -> float:
        """A streamed block's parameters (a GPU-updated block's state) host -> GPU, at the in-step rate if measured."""
        return nbytes / ((self.param_load_gbps or self.h2d_gbps) * 1e9)

    def grad_offload_seconds(self, nbytes: float) -> float:
        """A streamed block's gradient (a GPU-updated block's state) GPU -> host, at the in-step rate if measured."""
        return nbytes / ((self.grad_offload_gbps or self.d2h_gbps) * 1e9)

    def update_seconds(self, n_params: float, eight_bit: bool) -> float:
        """Host optimizer step over ``n_params`` parameters on all cores."""
        return n_params / ((self.cpu_adam8_gparams if eight_bit else self.cpu_adam_gparams) * 1e9)

    def gpu_update_seconds(self, n_params: float, eight_bit: bool) -> float:
        """Optimizer step of a resident block on the GPU: one fused pass, memory bound.  The 8-bit
        update moves ~20 bytes per parameter (fp32 gradient in, bf16 + low half and two codes in and
        out, the accumulator zeroed), fp32 AdamW ~38.  Device memory bandwidth is not in the profile;
        it is taken as ``bf16_tflops / 200`` TB/s, 60% reached (h200: 3.85 TB/s x 0.6) -- a rough
        figure, but this term is ~1% of a step (a 77 M parameter layer: 0.7 ms)."""
        per = 20 if eight_bit else 38
        return n_params * per / (self.bf16_tflops / 200 * 1e12 * 0.6)

    def nvme_seconds(self, nbytes: float, write: bool) -> float:
        return nbytes / ((self.nvme_write_gbps if write else self.nvme_read_gbps) * 1e9)

    def nvme_mixed_gbps(self) -> float:
        """GB/s of the disk reading and writing at once, both directions together: ``nvme_both_gbps`` where known,
        else the faster direction alone (an unmeasured drive is not assumed to overlap the two)."""
        return self.nvme_both_gbps or max(self.nvme_read_gbps, self.nvme_write_gbps)

    def collective_seconds(self, nbytes: float, world_size: int, nodes: int = 1, *, all_reduce: bool = False) -> float:
        """A ring all-gather or reduce-scatter whose gathered buffer is ``nbytes`` (each rank sends and
        receives ``(N - 1) / N`` of it, one latency per ring step); an all-reduce is both.  Across hosts
        the ring runs at the inter-host rate."""
        if world_size <= 1:
            return 0.0
        gbps, lat = (self.collective_gbps, self.collective_latency_s) if nodes <= 1 else \
            (self.internode_gbps, self.internode_latency_s)
        one = (world_size - 1) * (lat + nbytes / world_size / (gbps * 1e9))
        return 2 * one if all_reduce else one

    # --- JSON --------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """A versioned, JSON-serializable dict (``json.dumps(profile.to_json())``); a block timing without cut
        timings is written as it was before they existed."""
        d = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        d["calibration"] = [{k: v for k, v in t.items() if k != "cuts" or v} for t in d["calibration"]]
        return d

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        """Inverse of ``to_json``; unknown, missing or mistyped fields are a ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"a hardware profile is a JSON object, got {type(data).__name__}")
        data = dict(data)
        fmt, version = data.pop("format", FORMAT), data.pop("version", VERSION)
        if fmt != FORMAT:
            raise ValueError(f"not a hardware profile: format is {fmt!r}, expected {FORMAT!r}")
        if version != VERSION:
            raise ValueError(f"hardware profile version {version!r} is not supported (this LazyTrain reads {VERSION})")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown fields {unknown}")
            if missing:
                parts.append(f"missing fields {missing}")
            raise ValueError(f"bad hardware profile: {'; '.join(parts)}")
        if not isinstance(data.get("calibration", []), (list, tuple)):
            raise ValueError("bad hardware profile: calibration must be a list of block timings")
        data["calibration"] = tuple(BlockTiming.from_json(t) for t in data.get("calibration", []))
        # JSON has one number type; accept 139.0 for an int field, 5 for a float one
        for f in dataclasses.fields(cls):
            if f.name not in data or f.name == "calibration":
                continue
            value = data[f.name]
            if f.type == "int" and isinstance(value, float) and value.is_integer():
                data[f.name] = int(value)
            elif f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                data[f.name] = float(value)
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        try:
            return cls.from_json(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.gpu_name} {self.gpu_memory_bytes / GiB:.1f} GiB, "
            f"{self.bf16_tflops:.3g} TFLOP/s bf16 x {self.compute_efficiency:.3g} "
            f"+ {self.kernel_overhead_s * 1e6:.0f} us/launch, "
            f"PCIe {self.h2d_gbps:.3g}/{self.d2h_gbps:.3g} GB/s ({self.duplex_gbps:.3g} both, "
            f"pageable {self.pageable_h2d_gbps:.3g}/{self.pageable_d2h_gbps:.3g}), "
            f"host {self.cpu_cores} cores {self.host_memory_bytes / GiB:.0f} GiB, "
            f"AdamW {self.cpu_adam_gparams:.3g} G params/s, "
            f"disk {self.nvme_read_gbps:.3g}/{self.nvme_write_gbps:.3g} GB/s"
            + (f" ({self.nvme_both_gbps:.3g} both)" if self.nvme_both_gbps else "")
            + (f" at {self.nvme_queue_depth} x {self.nvme_request_bytes / MiB:.3g} MiB"
               if self.nvme_queue_depth else "")
        )
