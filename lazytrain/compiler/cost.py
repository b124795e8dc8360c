"""Cost model: seconds for every kind of work on a block, from the graph and a hardware profile.

All times are for one micro-batch where work is per micro-batch (compute, activation transfers)
and per block where it is per block (parameter load, gradient offload, host update).

A block's compute is measured where the hardware profile has a timing of its program at this
micro-batch (``HardwareProfile.calibration``, from ``lazytrain profile --model``: forward, backward and
recompute as LazyTrain's runtime ran them); where its program was timed only at other micro-batches, the
nearest of those timings scaled by the FLOP model's ratio between the two (``_from_other_micro_batch``); else
modelled from its FLOPs (``block_seconds``: matmuls and attention at their rates; recompute costs the same as
forward).

A compiled block's cut (``Decisions.cut``, ``frontend/cuts.py``) other than the min-cut changes its forward and
backward.  Where the calibration timed the cut (``block_timing.CutTiming``: ``lazytrain profile --model`` of a
compiled plan times every cut the compiler may choose), its forward and backward are the measured ones.  Else
the cut's backward is the min-cut backward plus the forward work the cut does not save: the block's recompute
time (measured or modelled) scaled by the cut's *modelled* share of it (its recomputed matmul and attention
FLOPs at their rates, over the forward's), and its forward is the block's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property

from ..ir import ModelGraph, TensorId, TensorKind, Tier
from ..ir.semantics import DEVICE_STATE_BYTES, GRAD_WIRE_BYTES, Sizes, host_state_bytes
from ..ir.summary import measured_blocks
from ..ir.tiers import Copy, copy, copy_rate
from ..util.torch_free import cuda_available
from .hardware import HardwareProfile
from .quant_cost import frozen_cost


@dataclass(frozen=True)
class CostModel:
    graph: ModelGraph
    hw: object                 # compiler.hardware.HardwareProfile
    micro_batch: int
    param_dtype: str = "bfloat16"
    eight_bit: bool = True
    #: blocks kept on the GPU (``Decisions.resident``): no loads, no gradient offload, update on the GPU
    resident: frozenset = frozenset()
    #: data-parallel ranks, and the hosts they are spread over (``ir.sharding``): each rank moves and
    #: updates its shard, with the host share the profile describes (one GPU's cores and PCIe link)
    world_size: int = 1
    nodes: int = 1
    #: each block's cut (``Decisions.cut``; empty: the min-cut everywhere)
    cut: tuple = ()
    #: streamed blocks updated on the GPU (``Decisions.gpu_update``): state in and out over PCIe, no host update
    gpu_updated: frozenset = frozenset()
    #: state kept on NVMe (``Decisions.nvme_state`` as ``Sizes.nvme`` pairs), and the host store's bytes per
    #: parameter (``options.host_bytes_per_param``), which size its host copies
    nvme: frozenset = frozenset()
    host_bytes_per_param: float = 8.25
    #: bits a frozen base parameter is held in on the host and moved in (``ir.semantics.frozen_bytes_per_param``)
    base_bits: int = 16

    @cached_property
    def sizes(self) -> Sizes:
        return Sizes(self.graph, self.micro_batch, self.param_dtype, resident=self.resident,
                     device_state_bytes=DEVICE_STATE_BYTES["hybrid8bit" if self.eight_bit else "adamw"],
                     world_size=self.world_size, cut=tuple(self.cut), gpu_updated=frozenset(self.gpu_updated),
                     nvme=self.nvme, host_state_bytes=host_state_bytes(self.host_bytes_per_param, self.param_dtype),
                     base_bits=self.base_bits)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def moving_param_bytes(self, j: int) -> int:
        """Parameter bytes that stream for block j (0 for a resident block: they stay on the GPU)."""
        return 0 if j in self.resident else self.param_bytes(j)

    @cached_property
    def measured(self) -> dict:
        """Block index -> ``BlockTiming`` for the blocks whose program was timed, as a step runs it
        (``BlockTiming.scaled`` by the profile's in-step scales): at this micro-batch, else at the nearest one timed
        (``_from_other_micro_batch``)."""
        find = getattr(self.hw, "measured", None)
        if find is None or not getattr(self.hw, "calibration", ()):
            return {}
        fs, bs = getattr(self.hw, "step_forward_scale", 1.0), getattr(self.hw, "step_backward_scale", 1.0)
        out = {}
        for j in range(self.graph.n_blocks):
            sig = self.graph.block_signature(j)
            t = find(sig, self.micro_batch) or self._from_other_micro_batch(j, sig)
            if t is not None:
                out[j] = t.scaled(fs, bs)
        return out

    def _from_other_micro_batch(self, j: int, sig: str):
        """Block j's timing at the micro-batch nearest this one (by ratio; the larger on a tie) that the calibration
        timed its program at, scaled to this micro-batch by the FLOP model's own ratio of the two (forwards by the
        forward's, backwards by the backward's); None where none was timed.  Not the FLOP model alone: it prices
        compiled blocks well above their measured time, so a calibration at one micro-batch would make every other
        look dearer than it is [ledger: cost-other-micro-batch]."""
        timed = [t for t in self.hw.calibration if t.signature == sig and t.micro_batch > 0]
        if not timed:
            return None
        mb = self.micro_batch
        t = min(timed, key=lambda t: (max(t.micro_batch, mb) / min(t.micro_batch, mb), -t.micro_batch))
        f0, b0 = self._modelled(j, t.micro_batch)
        f1, b1 = self._modelled(j, mb)
        return t.scaled(f1 / f0, b1 / b0) if f0 > 0 and b0 > 0 else None

    def _modelled(self, j: int, micro_batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of block j at ``micro_batch`` from its FLOPs (``block_seconds``)."""
        b = self.graph.blocks[j]
        fwd = self.hw.block_seconds(b.fwd_flops * micro_batch, ops=b.fwd_ops,
                                    attn_flops=b.attn_fwd_flops * micro_batch, head_dim=b.attn_head_dim,
                                    kv_len=b.attn_kv_len)
        bwd = self.hw.block_seconds(b.bwd_flops * micro_batch, ops=b.fwd_ops, backward=True,
                                    attn_flops=b.attn_bwd_flops * micro_batch, head_dim=b.attn_head_dim,
                                    kv_len=b.attn_kv_len)
        return fwd, bwd

    def fwd_s(self, j: int) -> float:
        """Forward of block j at its cut: the cut's measured forward where timed (module docstring)."""
        return self._block_s[j][0] + self.cut_forward_s(j, self.cut[j] if self.cut else 0)

    def saving_fwd_s(self, j: int) -> float:
        """Forward of block j when it saves for backward (kept or offloaded): at a cut, the cut's measured forward
        (``fwd_s``); at the min-cut, the measured recompute, which is that same saving forward.  Calibration's
        ``forward_s`` is the forward that saves nothing (a recomputed block's, under no grad), shorter than the
        saving one, so it would price kept blocks short [ledger: cost-saving-forward]."""
        k = self.cut[j] if self.cut else 0
        return self.fwd_s(j) if k else self._block_s[j][1]

    def recompute_s(self, j: int) -> float:
        """Forward again inside the backward: measured where timed, else the forward's time."""
        return self._block_s[j][1]

    def bwd_s(self, j: int) -> float:
        """Backward of block j at its cut: the min-cut backward plus what the cut recomputes."""
        k = self.cut[j] if self.cut else 0
        return self._block_s[j][2] + (self.cut_recompute_s(j, k) if k else 0.0)

    def cut_recompute_s(self, j: int, k: int) -> float:
        """Seconds block j's backward adds at cut ``k``, measured or modelled (module docstring; 0 for the
        min-cut).  A measured cut's may be below 0: its backward timed faster than the min-cut's."""
        if not k:
            return 0.0
        t = self.cut_timing(j, k)
        return t.backward_s - self._block_s[j][2] if t else self.recompute_s(j) * self._cut_share(j, k)

    def cut_forward_s(self, j: int, k: int) -> float:
        """Seconds block j's forward adds at cut ``k``: its measured forward at that cut less the block's (0 for
        the min-cut and where the cut was not timed)."""
        t = self.cut_timing(j, k) if k else None
        return t.forward_s - self._block_s[j][0] if t else 0.0

    def cut_timing(self, j: int, k: int):
        """The calibration's ``CutTiming`` of block j's cut ``k`` (None: not timed, or the min-cut)."""
        t = self.measured.get(j)
        if not k or t is None:
            return None
        c = self.graph.blocks[j].cuts[k]
        return t.cut(c.budget, c.saved_bytes)

    def _cut_share(self, j: int, k: int) -> float:
        """Cut k's recomputed work as a share of block j's forward, both modelled from FLOPs (kernels only: the
        dispatch floor is the forward's, which the backward issues anyway)."""
        b, c = self.graph.blocks[j], self.graph.blocks[j].cuts[k]
        mb, hw = self.micro_batch, self.hw

        def kernels(flops, attn):
            return hw.block_seconds(flops * mb, launches=0, attn_flops=attn * mb, head_dim=b.attn_head_dim,
                                    kv_len=b.attn_kv_len)
        fwd = kernels(b.fwd_flops, b.attn_fwd_flops)
        return kernels(c.recompute_flops, c.recompute_attn_flops) / fwd if fwd > 0 else 0.0

    def n_cuts(self, j: int) -> int:
        """Cuts the compiler may choose for block j (1: the min-cut only)."""
        return max(len(self.graph.blocks[j].cuts), 1)

    @cached_property
    def _block_s(self) -> tuple[tuple[float, float, float], ...]:
        """(forward, recompute, backward) seconds per block, computed once: the lowering asks for them once per
        micro-batch and block (~20,000 times for 72 micro-batches of an 80-layer model)."""
        out = []
        for j in range(self.graph.n_blocks):
            if j in self.measured:
                t = self.measured[j]
                out.append((t.forward_s, t.recompute_s, t.backward_s))
                continue
            fwd, bwd = self._modelled(j, self.micro_batch)
            out.append((fwd, fwd, bwd))
        return tuple(out)

    def param_bytes(self, j: int) -> int:
        return self.graph.blocks[j].param_numel * self.sizes.param_bytes

    @cached_property
    def grad_wire_bytes(self) -> int:
        """Bytes per gradient element on the way to the host: fp32 for fp32 parameters, else the wire dtype."""
        return 4 if self.sizes.param_bytes == 4 else GRAD_WIRE_BYTES

    def grad_bytes(self, j: int) -> int:
        """Gradient bytes one rank's ``grad_offload`` copies (its shard in a world of several)."""
        if self.sharded:
            return self.sizes.shard_numel(j) * self.grad_wire_bytes
        return self.sizes.grad_numel(j) * self.grad_wire_bytes

    def load_bytes(self, j: int) -> int:
        """Parameter bytes one rank's ``load`` copies: the block's, or with several ranks its shard."""
        if j in self.resident:
            return 0
        return self.sizes.load_bytes(j)        # a frozen base's part in its bits (``Sizes.frozen_bytes``)

    def load_s(self, j: int) -> float:
        """The block's parameters over PCIe, then its quantized frozen segment dequantized (``dequant_s``): the
        runtime does both on the copy stream (``handlers.load``), so the block's compute waits for the pair and
        overlaps the next load's; priced as part of the load, where the schedule already hides or waits for it."""
        return self.hw.param_load_seconds(self.load_bytes(j)) + (0.0 if j in self.resident else self.dequant_s(j))

    def dequant_s(self, j: int) -> float:
        """GPU seconds dequantizing block j's own frozen parameters after they land (0 at 16 bits:
        ``compiler.quant_cost.frozen_cost``, at the profile's ``dequant_gbps`` / ``dequant8_gbps``)."""
        return self._dequant_s[j]

    @cached_property
    def _dequant_s(self) -> tuple[float, ...]:
        if self.base_bits == 16 or self.sharded:
            return (0.0,) * self.graph.n_blocks
        pb = self.sizes.param_bytes
        return tuple(frozen_cost([p for p in b.params if not p.trainable and p.owner == b.index], self.base_bits,
                                 pb, self.hw).dequant_seconds for b in self.graph.blocks)

    def all_gather_s(self, j: int) -> float:
        """The block's parameters assembled from every rank's shard (ring all-gather)."""
        n = self.sizes.of(TensorId(kind=TensorKind.PARAMS, index=j))
        return self.hw.collective_seconds(n, self.world_size, self.nodes)

    def reduce_scatter_s(self, j: int) -> float:
        """The block's fp32 gradient summed over the ranks, each keeping its shard (ring reduce-scatter)."""
        n = self.sizes.of(TensorId(kind=TensorKind.GRADS, index=j))
        return self.hw.collective_seconds(n, self.world_size, self.nodes)

    def all_reduce_s(self) -> float:
        """The ranks' squared gradient norms summed: one fp32 per block, latency bound."""
        return self.hw.collective_seconds(4 * self.graph.n_blocks, self.world_size, self.nodes, all_reduce=True)

    def grad_offload_s(self, j: int) -> float:
        """The block's gradient to the host; for the owner of a tied parameter, plus the host sum of
        its readers' shares (``tied_sum_s``), which the step waits for before its clip coefficient."""
        if j in self.resident or j in self.gpu_updated:
            return 0.0
        return self.hw.grad_offload_seconds(self.grad_bytes(j)) + self.tied_sum_s(j)

    def tied_sum_s(self, j: int) -> float:
        """Host time to add the readers' gradients of block j's tied parameters to its own (one fused
        pass reading both in the wire dtype and writing fp32), at the memory rate of the host update,
        which moves ~14 bytes per parameter (``runtime/optim/ckernel.py``)."""
        n = self._tied_numel.get(j, 0)
        if not n:
            return 0.0
        return self.hw.update_seconds(n, self.eight_bit) * (2 * self.grad_wire_bytes + 4) / 14

    @cached_property
    def _tied_numel(self) -> dict[int, int]:
        """Owner block -> elements of its parameters that other blocks read (each parameter once)."""
        shared: dict[int, dict[str, int]] = {}
        for b in self.graph.blocks:
            for p in b.params:
                if p.owner != b.index:
                    shared.setdefault(p.owner, {})[p.name] = p.numel
        return {o: sum(ps.values()) for o, ps in shared.items()}

    def update_s(self, j: int) -> float:
        """The block's optimizer step where it runs: on the host, or on the GPU for a resident block."""
        n = self.graph.blocks[j].trainable_numel      # a frozen parameter is not updated
        if not n:
            return 0.0
        if j in self.resident:      # with several ranks, its shard
            return self.hw.gpu_update_seconds(n / self.world_size if self.sharded else n, self.eight_bit)
        if j in self.gpu_updated:
            return self.hw.gpu_update_seconds(n, self.eight_bit)
        if self.sharded:     # each rank updates its 1/N with its GPU's share of the host (the profile's cores)
            return self.hw.update_seconds(n / self.world_size, self.eight_bit)
        return self.hw.update_seconds(n, self.eight_bit)

    def host_update_s(self, j: int) -> float:
        return 0.0 if j in self.resident or j in self.gpu_updated else self.update_s(j)

    def gpu_update_s(self, j: int) -> float:
        return self.update_s(j) if j in self.resident or j in self.gpu_updated else 0.0

    def state_bytes(self, j: int, load: bool = True) -> int:
        """What a GPU-updated block's ``state_load`` (``load``) or ``state_store`` moves: the optimizer state beyond
        the parameters (``Sizes.of(ostate[j])``) and the parameters: the load brings the whole block (its forward
        reads them; a frozen base's part in its bits), the store takes back the trainable ones it updated."""
        state = self.sizes.of(TensorId(kind=TensorKind.OPT_STATE, index=j))
        if load:
            return self.sizes.load_bytes(j) + state
        return self.graph.blocks[j].trainable_numel * self.sizes.param_bytes + state

    def state_load_s(self, j: int) -> float:
        """A GPU-updated block's parameters and optimizer state host -> GPU: the model's own state, copied from
        pinned host memory like a parameter load, at the same in-step rate."""
        return self.hw.param_load_seconds(self.state_bytes(j)) + self.dequant_s(j)

    def state_store_s(self, j: int) -> float:
        """... and back GPU -> host after its update, like a gradient offload."""
        return self.hw.grad_offload_seconds(self.state_bytes(j, load=False))

    def act_bytes(self, i: int) -> int:
        return self.graph.boundary_bytes[i] * self.micro_batch

    def saved_bytes(self, j: int, cut: int | None = None) -> int:
        """Bytes block j saves per micro-batch at ``cut`` (default: this cost model's cut of it)."""
        return self.sizes.saved_per_sample(j, cut) * self.micro_batch

    def copy_s(self, c: Copy, nbytes: int) -> float:
        """One copy of ``nbytes`` between two tiers, at the profile's bandwidth for it (``ir.tiers``)."""
        return nbytes / copy_rate(self.hw, c)

    def d2h_s(self, nbytes: int) -> float:
        return self.copy_s(copy(Tier.GPU, Tier.HOST), nbytes)

    def h2d_s(self, nbytes: int) -> float:
        return self.copy_s(copy(Tier.HOST, Tier.GPU), nbytes)



def hint_uncalibrated(plan, model=None):
    """Print one line to stderr when this machine has a GPU, the plan is for a GPU and none of its
    blocks' times is measured: how to measure them.  Returns ``plan``."""
    if plan.hardware.get("gpu_name") == HardwareProfile.NO_GPU or measured_blocks(plan) or not cuda_available():
        return plan
    name = model if isinstance(model, str) else "MODEL"
    print(f"lazytrain: block times are modelled, not measured: `lazytrain profile --model {name} --seq "
          f"{plan.seq_len} --micro-batch {plan.micro_batch} -o hw.json` and --hardware hw.json (or "
          f"compile(..., calibrate=True)) measure them on this GPU", file=sys.stderr)
    return plan
