"""What each op reads, writes, drops and changes in place: the one definition that the lowering's
dependencies, verify, the simulator and the runtime's memory accounting share (``docs/architecture.md``,
"Effects").  Sizes come from the graph, the micro-batch and the dtypes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from ..util.quant_format import BITS, CHUNK, bytes_per_param, packed_nbytes, quantized_param
from .graph import DTYPE_BYTES, ModelGraph
from .ops import Op, OpKind, TensorId, TensorKind, Tier, tensor_id
from .sharding import block_sections, sections_owned_shard_numel, sections_shard_numel

GRAD_ACCUM_BYTES = 4   # gradients accumulate in fp32 on the GPU (exact over micro-batches)
GRAD_WIRE_BYTES = 2    # and cross PCIe / live on the host in bf16 (the clip norm is taken before)
#: values per scale of a quantized frozen base (QLoRA's and torchao's NF4 block; ``runtime/quantized.py``)
QUANT_BLOCK = 64
#: GPU bytes per value of the dequantization's temporaries, for one chunk (``util.quant_format.CHUNK``) at most
#: (``QuantizedSegment.dequantize_into``): NF4's int32 codes (2 a value: one code a byte pair) and its looked-up
#: values (up to 4 a value, fp32), or int8's promoted product (4), rounded up
DEQUANT_BYTES_PER_VALUE = 8


#: GPU bytes per parameter the optimizer keeps for a resident block beyond the parameters: the 8-bit
#: optimizer's low master half (2), two 1-byte moment codes, block scales and kernel table; fp32 AdamW's fp32
#: master (0 when the parameters are fp32) and two fp32 moments
DEVICE_STATE_BYTES = {"hybrid8bit": 4.02, "hybrid8bit-sr": 2.02, "hybrid4bit": 3.25, "hybrid4bit-sr": 1.25,
                      "adamw": 12.0}


def frozen_bytes_per_param(base_bits: int, param_bytes: int) -> float:
    """Bytes a frozen parameter takes on the host and over PCIe with the base in ``base_bits``, in the limit of a
    large matrix (``util.quant_format.bytes_per_param``: the runtime's own layout, one source for both): 16 is the
    parameter dtype's ``param_bytes``; 8 block-wise absmax int8 (an fp32 scale per 64 values, 1.0625); 4 NF4
    (QLoRA's: an int8 scale per 64 values, those double-quantized with a factor per 256 of them, 0.5157 at bf16).
    A block's exact bytes, norms kept raw and padding included, are ``Sizes.frozen_host_bytes``."""
    if base_bits not in BITS:
        raise ValueError(f"base_bits must be 16, 8 or 4 (got {base_bits})")
    return float(param_bytes) if base_bits == 16 else bytes_per_param(base_bits, QUANT_BLOCK, param_bytes)


def static_host_bytes(graph: ModelGraph, host_bytes_per_param: float, param_dtype: str, base_bits: int = 16) -> float:
    """Host bytes of the training state in a world of one: ``host_bytes_per_param`` (the load and gradient buffers
    and the optimizer's state) per trainable parameter, the base's bytes alone per frozen one."""
    return (graph.trainable_params * host_bytes_per_param
            + graph.frozen_params * frozen_bytes_per_param(base_bits, DTYPE_BYTES[param_dtype]))


def tie_closure(graph: ModelGraph, blocks) -> frozenset[int]:
    """``blocks`` plus every block that shares a tied parameter with one of them (transitively):
    a resident block's tied links point into its owner's GPU buffer and their gradients add into
    the owner's GPU accumulator, so a tie group is resident as a whole or not at all."""
    out = set(blocks)
    todo = list(out)
    while todo:
        j = todo.pop()
        for k in {*graph.owners(j), *graph.readers(j)} - out:
            out.add(k)
            todo.append(k)
    return frozenset(out)


@dataclass(frozen=True)
class Sizes:
    graph: ModelGraph
    micro_batch: int
    param_dtype: str = "bfloat16"
    #: blocks kept on the GPU for the whole run (``Decisions.resident``)
    resident: frozenset = frozenset()
    #: the optimizer's GPU bytes per parameter for a resident block (``DEVICE_STATE_BYTES``)
    device_state_bytes: float = DEVICE_STATE_BYTES["hybrid8bit"]
    #: data-parallel ranks (``ir.sharding``): parameters and gradients on the GPU are the padded
    #: gathered buffer, the host gradient and the shards one rank's slice
    world_size: int = 1
    #: each block's cut (``Decisions.cut``; empty: every block's min-cut): what ``saved[j]`` holds
    cut: tuple[int, ...] = ()
    #: streamed blocks updated on the GPU (``Decisions.gpu_update``): their accumulator is kept across steps
    gpu_updated: frozenset = frozenset()
    #: state kept on NVMe (``Decisions.nvme_state``), as (tensor kind, block) pairs: the host copy of each is a
    #: plan value, its file the static copy
    nvme: frozenset = frozenset()
    #: host bytes per owned parameter of the optimizer state beyond the parameters and the gradient
    #: (``ostate[j]`` on the host: the 8-bit optimizer's master low half and moments, 4.25)
    host_state_bytes: float = 4.25
    #: bits a frozen (base) parameter is held in on the host and moved in (``frozen_bytes_per_param``)
    base_bits: int = 16

    @classmethod
    def of_plan(cls, plan, like: Sizes | None = None) -> Sizes:
        """The sizes a plan's ops imply (its graph, micro-batch, dtype, resident blocks, optimizer; an
        optimizer the file does not name as one of ``DEVICE_STATE_BYTES`` counts as the 8-bit one).  ``like``
        where it equals them: its tables, computed on first use, are reused (the cost model's that lowered the
        plan holds them)."""
        opt = plan.options.get("optimizer")
        per = DEVICE_STATE_BYTES.get(opt, None) if isinstance(opt, str) else None
        sizes = cls(plan.graph, plan.micro_batch, plan.param_dtype, resident=plan.decisions.resident_blocks,
                    device_state_bytes=DEVICE_STATE_BYTES["hybrid8bit"] if per is None else per,
                    world_size=plan.world_size, cut=plan.decisions.cut, gpu_updated=plan.decisions.gpu_updated_blocks,
                    nvme=nvme_pairs(plan.decisions.nvme_state),
                    host_state_bytes=host_state_bytes(float(plan.options.get("host_bytes_per_param", 16.0)),
                                                      plan.param_dtype),
                    base_bits=int(plan.options.get("base_bits", 16)))
        return like if like is not None and like == sizes else sizes

    def saved_per_sample(self, block: int, cut: int | None = None) -> int:
        """Bytes block j's forward saves per sample at ``cut`` (default: this plan's cut of it)."""
        b = self.graph.blocks[block]
        k = (self.cut[block] if self.cut else 0) if cut is None else cut
        return b.cuts[k].saved_bytes if k else b.saved_bytes

    def recompute_transient(self, block: int) -> int:
        """What a cut's backward regenerates, live while it runs: at most the min-cut's saved bytes beyond the
        cut's, for one micro-batch (0 at the min-cut)."""
        return max(self.graph.blocks[block].saved_bytes - self.saved_per_sample(block), 0) * self.micro_batch

    def resident_bytes(self) -> int:
        """GPU bytes held for the whole run by resident blocks: parameters, optimizer state and
        the fp32 gradient accumulator of every owned parameter (tied links are views of the owner's);
        with several ranks, of this rank's shard of them (the gathered parameters are plan tensors)."""
        per = self.resident_bytes_per_param()
        return int(sum(self.trainable_shard_numel(j) * per + self.frozen_shard_numel(j) * self.param_bytes
                       for j in self.resident))

    def resident_bytes_per_param(self) -> float:
        """GPU bytes per owned parameter of a resident block (see ``resident_bytes``)."""
        per = self.param_bytes + self.device_state_bytes + GRAD_ACCUM_BYTES
        return per - 4 if self.param_bytes == 4 else per     # fp32 parameters are their own master

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def frozen_bytes(self) -> float:
        """Host and PCIe bytes per frozen parameter (``frozen_bytes_per_param``)."""
        return frozen_bytes_per_param(self.base_bits, self.param_bytes)

    def host_param_bytes(self, block: int) -> int:
        """Bytes of block ``block``'s load buffer (its owned parameters: the trainable ones in the parameter
        dtype, the frozen ones in the base's bits)."""
        b = self.graph.blocks[block]
        return int(b.trainable_numel * self.param_bytes + self.frozen_host_bytes(block))

    def load_bytes(self, block: int) -> int:
        """Bytes a load of block ``block`` moves host -> GPU (tied links included; one rank's shard): its own frozen
        segment packed (``frozen_host_bytes``), a frozen tied link at the per-parameter rate."""
        if self.world_size != 1:
            return self.shard_numel(block) * self.param_bytes
        b = self.graph.blocks[block]
        links = sum(p.numel for p in b.params if not p.trainable and p.owner != block)
        frozen = sum(p.numel for p in b.params if not p.trainable)
        return int((b.param_numel - frozen) * self.param_bytes + self.frozen_host_bytes(block)
                   + links * self.frozen_bytes)

    def frozen_host_bytes(self, block: int) -> int:
        """Bytes of block ``block``'s own frozen segment in its load buffer: the parameter dtype's at 16 bits, else
        the packed buffer's (``util.quant_format.packed_nbytes``: what the runtime's ``QuantizedSegment`` holds and a
        load moves, norms kept raw and each matrix padded to whole blocks)."""
        return self._frozen_layout[block][0]

    def dequant_transient(self, block: int) -> int:
        """GPU bytes a load of block ``block`` holds beyond its parameters while it runs: the packed frozen segment
        copied there and the dequantization's temporaries (one chunk's at most); 0 at 16 bits."""
        return self._frozen_layout[block][1]

    @cached_property
    def _frozen_layout(self) -> tuple[tuple[int, int], ...]:
        """Per block (host bytes of its own frozen segment, GPU transient of dequantizing it)."""
        out = []
        for b in self.graph.blocks:
            frozen = [p for p in b.params if not p.trainable and p.owner == b.index]
            n = sum(p.numel for p in frozen)
            if self.base_bits == 16 or not frozen:
                out.append((n * self.param_bytes, 0))
                continue
            q = [p.numel for p in frozen if quantized_param(p.name, p.shape)]
            packed = packed_nbytes(q, n - sum(q), self.base_bits, QUANT_BLOCK, self.param_bytes)
            out.append((packed, packed + min(sum(q), CHUNK) * DEQUANT_BYTES_PER_VALUE if q else packed))
        return tuple(out)

    def grad_numel(self, block: int) -> int:
        """Elements of block ``block``'s gradient (its trainable parameters read; with several ranks, the padded
        gathered buffer, where every parameter trains)."""
        return self.graph.blocks[block].grad_numel if self.world_size == 1 else self._param_numel[block]

    def trainable_shard_numel(self, block: int) -> int:
        """Elements of the block's shard this rank updates that train (several ranks: all of them train)."""
        if self.world_size == 1:
            return self.graph.blocks[block].trainable_numel
        return self.owned_shard_numel(block)

    def frozen_shard_numel(self, block: int) -> int:
        return self.graph.blocks[block].frozen_numel if self.world_size == 1 else 0

    def kept_grad_bytes(self) -> int:
        """GPU bytes of the accumulators GPU-updated blocks keep from their backward into the next step (on the
        GPU when the step begins, until each block's update)."""
        return sum(self.of(TensorId(kind=TensorKind.GRADS, index=j)) for j in self.gpu_updated)

    def of(self, t: TensorId, tier: Tier = Tier.GPU) -> int:
        """Bytes of one copy of ``t`` on ``tier`` (the same for every micro-batch), memoized: verify and the
        simulator ask for every write and drop."""
        key = (t.kind, t.index, tier)
        n = self._bytes.get(key)
        if n is None:
            n = self._bytes[key] = self._bytes_of(t, tier)
        return n

    @cached_property
    def _bytes(self) -> dict[tuple, int]:
        return {}

    def _bytes_of(self, t: TensorId, tier: Tier) -> int:
        if t.kind is TensorKind.PARAMS:     # the host keeps a block's own parameters (a tied link is its owner's)
            if tier is Tier.HOST:
                return self.host_param_bytes(t.index)
            return self._param_numel[t.index] * self.param_bytes
        if t.kind is TensorKind.GRADS:      # of the trainable parameters only (none: an empty gradient)
            per = GRAD_ACCUM_BYTES if tier is Tier.GPU else GRAD_WIRE_BYTES
            if self.param_bytes == 4:   # fp32 training keeps fp32 gradients everywhere
                per = 4
            n = self.grad_numel(t.index) if tier is Tier.GPU or self.world_size == 1 else self.shard_numel(t.index)
            return n * per
        if t.kind is TensorKind.PARAM_SHARD:
            return self.shard_numel(t.index) * self.param_bytes
        if t.kind is TensorKind.GRAD_SHARD:     # the reduce_scatter sums the fp32 accumulators
            return self.shard_numel(t.index) * GRAD_ACCUM_BYTES
        if t.kind is TensorKind.OPT_STATE:      # what the optimizer keeps beyond the parameters (an upper bound
            # for fp32 parameters, which are their own master)
            per = self.host_state_bytes if tier is Tier.HOST else self.device_state_bytes
            return int(self.graph.blocks[t.index].trainable_numel * per)
        if t.kind in (TensorKind.ACT, TensorKind.GRAD_ACT):
            return self.graph.boundary_bytes[t.index] * self.micro_batch
        if t.kind is TensorKind.SAVED:
            return self.saved_per_sample(t.index) * self.micro_batch
        raise ValueError(t)

    def readers(self, owner: int) -> tuple[int, ...]:
        """``ModelGraph.readers``, computed once per block (``effects`` asks for it on every op)."""
        return self._readers[owner]

    def owners(self, block: int) -> tuple[int, ...]:
        """``ModelGraph.owners``, computed once per block."""
        return self._owners[block]

    def shard_numel(self, block: int) -> int:
        """Elements of one rank's shard of the block (all of them in a world of one)."""
        return self._shard_numel[block]

    def owned_shard_numel(self, block: int) -> int:
        """Elements of the block's shard this rank updates (its owned elements in a world of one)."""
        if self.world_size == 1:
            return self.graph.blocks[block].owned_numel
        return sections_owned_shard_numel(self._sections[block], block, self.world_size)

    @cached_property
    def _sections(self):
        return block_sections(self.graph)

    @cached_property
    def _param_numel(self) -> tuple[int, ...]:
        if self.world_size == 1:
            return tuple(b.param_numel for b in self.graph.blocks)
        return tuple(self.world_size * s for s in self._shard_numel)

    @cached_property
    def _shard_numel(self) -> tuple[int, ...]:
        if self.world_size == 1:
            return self._param_numel
        return tuple(sections_shard_numel(secs, self.world_size) for secs in self._sections)

    @cached_property
    def _readers(self) -> tuple[tuple[int, ...], ...]:
        return self.graph.all_readers()

    @cached_property
    def _owners(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.graph.owners(j) for j in range(self.graph.n_blocks))

    def workspace(self, block: int) -> int:
        """Block ``block``'s transient in its forward and recompute at this micro-batch: the traced figure, or
        the measured one where a calibration raised it (``compiler/measured_workspace.py``)."""
        return self._per_sample_workspace[block][0] * self.micro_batch + self.graph.blocks[block].workspace_fixed_bytes

    def backward_workspace(self, block: int) -> int:
        """Block ``block``'s transient in its backward: the largest of its forward's, the traced backward figure
        (an op's values next to their gradients, ``frontend/trace.py``) and a measured one."""
        return self._per_sample_workspace[block][1] * self.micro_batch + self.graph.blocks[block].workspace_fixed_bytes

    @cached_property
    def _per_sample_workspace(self) -> tuple[tuple[int, int], ...]:
        """Per block (forward, backward) workspace per sample, computed once: ``effects`` asks on every op."""
        n = self.graph.n_blocks
        fwd = self.graph.meta.get("measured_workspace") or (0,) * n
        bwd = self.graph.meta.get("measured_backward_workspace") or (0,) * n
        out = []
        for j, b in enumerate(self.graph.blocks):
            forward = max(b.workspace_bytes, fwd[j])
            out.append((forward, max(forward, b.backward_workspace_bytes, bwd[j])))
        return tuple(out)

    def param_grad_transient(self, block: int) -> int:
        """Backward returns all of a block's parameter gradients at once (``autograd.grad``), in the
        parameter dtype, before they are added into the fp32 accumulator: one params-sized transient
        (measured: 0.58 GiB for qwen2.5-3b's embedding, 0.14 GiB per layer)."""
        return self.grad_numel(block) * self.param_bytes

    def grad_cast_transient(self, block: int) -> int:
        """``grad_offload`` casts the fp32 accumulator (or this rank's shard of it) to the host gradient
        dtype on the GPU first (fp32 training keeps fp32 gradients: no cast)."""
        return 0 if self.param_bytes == 4 else self.of(TensorId(kind=TensorKind.GRADS, index=block), Tier.HOST)


Value = tuple[TensorId, Tier]    # one copy of a tensor: the unit that is resident, read, written


def host_state_bytes(host_bytes_per_param: float, param_dtype: str) -> float:
    """Host bytes per parameter of the optimizer state beyond the load and gradient buffers (``ostate[j]``)."""
    p = DTYPE_BYTES[param_dtype]
    return max(0.0, host_bytes_per_param - p - (4 if p == 4 else GRAD_WIRE_BYTES))


def nvme_pairs(nvme_state: dict) -> frozenset:
    """``Decisions.nvme_state`` as the (tensor kind, block) pairs ``Sizes.nvme`` holds."""
    return frozenset((TensorKind(k), j) for k, blocks in nvme_state.items() for j in blocks)


def resident_shards(sizes: Sizes, j: int) -> tuple[Value, ...]:
    """With several ranks, what resident block j keeps on the GPU for the whole run as plan values: its
    parameter shard (``pshard[j]``, which its ``update`` changes and every ``all_gather`` of a block
    reading it copies) and its gradient shard accumulator (``gshard[j]``, which ``reduce_scatter`` adds
    into and the ``update`` reads and clears).  Resident for the whole run, like the host store: not
    counted as plan memory (``resident_bytes`` is).  None in a world of one."""
    if sizes.world_size == 1 or j not in sizes.resident:
        return ()
    return ((TensorId(kind=TensorKind.PARAM_SHARD, index=j), Tier.GPU),
            (TensorId(kind=TensorKind.GRAD_SHARD, index=j), Tier.GPU))


@dataclass(frozen=True, slots=True)
class Effects:
    reads: tuple[Value, ...]
    writes: tuple[Value, ...]      # copies the op creates (or, for a GPU gradient, adds into)
    drops: tuple[Value, ...]       # copies the op releases
    transient: int = 0             # bytes on the GPU only while the op runs
    #: copies the op overwrites in place, neither creating nor releasing them: the host parameters an
    #: ``update`` writes (and every later ``load`` of a block reading them copies)
    mutates: tuple[Value, ...] = ()


def effects(op: Op, sizes: Sizes) -> Effects:
    """Reads, writes, drops and in-place writes of one op (the op list's operational semantics).

    The host parameters ``params[o] on host`` are the host store's load buffers: resident for the whole
    run (not counted as plan memory), read by every ``load`` of a block that reads block o's
    parameters and overwritten by o's ``update``; only their order matters.

    Each kind's rule is its function in ``EFFECTS`` (a compile asks once per op, ~10^5 times for 80 blocks)."""
    return effects_of(op.kind, op.block, op.mb, op.tensor, op.src, op.dst, op.save, sizes)


# the enum members the effects read, as module constants: they run once per op (~10^5 times a compile), and in
# Python 3.11 reading a member off its Enum class costs ten times a global (EnumType's ``__getattr__`` keeps the
# read off the interpreter's attribute cache)
_PARAMS, _GRADS, _ACT, _SAVED, _GRAD_ACT, _PARAM_SHARD, _GRAD_SHARD, _OPT_STATE = (
    TensorKind.PARAMS, TensorKind.GRADS, TensorKind.ACT, TensorKind.SAVED, TensorKind.GRAD_ACT, TensorKind.PARAM_SHARD,
    TensorKind.GRAD_SHARD, TensorKind.OPT_STATE)
_GPU_TIER, _HOST_TIER, _NVME_TIER = Tier.GPU, Tier.HOST, Tier.NVME


def effects_of(k: OpKind, j: int, m: int | None, tensor: TensorId | None, src: Tier | None, dst: Tier | None,
               save: bool, sizes: Sizes) -> Effects:
    """``effects`` of the op with these fields (kind, block, mb, tensor, src, dst, save; the others do not
    change what it touches): the lowering asks before it builds the op, whose deps follow from them."""
    fn = EFFECTS.get(k)
    if fn is None:
        raise ValueError(f"unknown op kind {k}")
    return fn(j, m, tensor, src, dst, save, sizes)


def _free(j, m, tensor, src, dst, save, sizes) -> Effects:
    return Effects((), (), ((tensor, src),))


def _copy(j, m, tensor, src, dst, save, sizes) -> Effects:
    """``offload`` and ``reload``: one copy of a value from one tier to another (``ir.tiers``)."""
    return Effects(((tensor, src),), ((tensor, dst),), ())


def _param_reads(j: int, sizes: Sizes) -> tuple[Value, ...]:
    """Block j's parameters on the GPU, as its forward and backward read them.  A resident block's parameters
    and gradients are not plan tensors in a world of one; with several ranks only its shards are
    (``resident_shards``): the gathered parameters and accumulator are."""
    if j in sizes.resident and sizes.world_size == 1:
        return ()
    return ((tensor_id(_PARAMS, j), _GPU_TIER),)


def _forward(j: int, m: int | None, tensor: TensorId | None, save: bool, recompute: bool, sizes: Sizes) -> Effects:
    """``compute`` (``recompute``: always saving) of block j: its output boundary, and what its backward needs
    where it saves; a recompute of a segment's last block writes only that (its ``tensor`` is ``saved[j]``)."""
    G = _GPU_TIER
    reads = (*_param_reads(j, sizes), (tensor_id(_ACT, j, m), G))
    writes = []
    if not recompute or tensor is None or tensor.kind is _ACT:
        if j + 1 < sizes.graph.n_blocks:
            writes.append((tensor_id(_ACT, j + 1, m), G))
    if save or recompute:
        writes.append((tensor_id(_SAVED, j, m), G))
    return Effects(reads, tuple(writes), (), sizes.workspace(j))


def _compute(j, m, tensor, src, dst, save, sizes) -> Effects:
    return _forward(j, m, tensor, save, False, sizes)


def _recompute(j, m, tensor, src, dst, save, sizes) -> Effects:
    return _forward(j, m, tensor, save, True, sizes)


def _backward(j, m, tensor, src, dst, save, sizes) -> Effects:
    G = _GPU_TIER
    pread = _param_reads(j, sizes)
    saved = tensor_id(_SAVED, j, m)
    reads = [*pread, (saved, G)]
    drops = [(saved, G)]
    if j + 1 < sizes.graph.n_blocks:
        dout = tensor_id(_GRAD_ACT, j + 1, m)
        reads.append((dout, G))
        drops.append((dout, G))
    writes = [(tensor_id(_GRADS, j), G)] if pread else []
    if j > 0:
        writes.append((tensor_id(_GRAD_ACT, j, m), G))
    return Effects(tuple(reads), tuple(writes), tuple(drops),
                   sizes.backward_workspace(j) + sizes.param_grad_transient(j) + sizes.recompute_transient(j))


def _load(j, m, tensor, src, dst, save, sizes) -> Effects:
    """With several ranks: this rank's shard, which an all_gather completes."""
    host = tuple((tensor_id(_PARAMS, o), _HOST_TIER) for o in sizes.owners(j))
    dst = tensor_id(_PARAMS, j) if sizes.world_size == 1 else tensor_id(_PARAM_SHARD, j)
    return Effects(host, ((dst, _GPU_TIER),), (), sizes.dequant_transient(j))     # (a quantized base's staging)


def _grad_offload(j, m, tensor, src, dst, save, sizes) -> Effects:
    G = _GPU_TIER
    g = tensor_id(_GRADS, j)
    src = g if sizes.world_size == 1 else tensor_id(_GRAD_SHARD, j)
    return Effects(((src, G),), ((g, _HOST_TIER),), ((src, G),), sizes.grad_cast_transient(j))


def _update(j, m, tensor, src, dst, save, sizes) -> Effects:
    """Consumes the host gradients of every block that reads j's parameters ..."""
    if j in sizes.resident:         # ... or, on the GPU, the accumulator it owns for the whole run
        return Effects((), (), (), mutates=resident_shards(sizes, j))
    G = _GPU_TIER
    params = tensor_id(_PARAMS, j)
    if j in sizes.gpu_updated:      # ... or the accumulator kept on the GPU since the last backward
        acc = (tensor_id(_GRADS, j), G)
        state = (tensor_id(_OPT_STATE, j), G)
        return Effects((acc, state, (params, G)), (), (acc,), mutates=(state, (params, G)))
    gs = tuple((tensor_id(_GRADS, c), _HOST_TIER) for c in sizes.readers(j))
    if (_OPT_STATE, j) in sizes.nvme:   # ... and the optimizer state a state_read brought from NVMe
        return Effects(gs, (), gs, mutates=((params, _HOST_TIER), (tensor_id(_OPT_STATE, j), _HOST_TIER)))
    return Effects(gs, (), gs, mutates=((params, _HOST_TIER),))


def _all_gather(j, m, tensor, src, dst, save, sizes) -> Effects:
    """A resident block's shards (its own and its tied owners') stay."""
    G = _GPU_TIER
    params = tensor_id(_PARAMS, j)
    if j in sizes.resident:
        return Effects(tuple((tensor_id(_PARAM_SHARD, o), G) for o in sizes.owners(j)), ((params, G),), ())
    shard = (tensor_id(_PARAM_SHARD, j), G)
    return Effects((shard,), ((params, G),), (shard,))


def _reduce_scatter(j, m, tensor, src, dst, save, sizes) -> Effects:
    """A resident block's adds into its owners' resident shard accumulators."""
    G = _GPU_TIER
    acc = (tensor_id(_GRADS, j), G)
    if j in sizes.resident:
        return Effects((acc,), (), (acc,), mutates=tuple((tensor_id(_GRAD_SHARD, o), G) for o in sizes.owners(j)))
    return Effects((acc,), ((tensor_id(_GRAD_SHARD, j), G),), (acc,))


def _all_reduce(j, m, tensor, src, dst, save, sizes) -> Effects:
    """The norms it sums are not plan values (its wait on the grad_offloads is ``ir.order``'s "norm"), but
    resident blocks' accumulators are read where they are."""
    return Effects(tuple((tensor_id(_GRAD_SHARD, r), _GPU_TIER) for r in sorted(sizes.resident)), (), ())


def _state_load(j, m, tensor, src, dst, save, sizes) -> Effects:
    """A GPU-updated block's parameters and state, for its update and forward."""
    G, H = _GPU_TIER, _HOST_TIER
    params, state = tensor_id(_PARAMS, j), tensor_id(_OPT_STATE, j)
    return Effects(((params, H), (state, H)), ((params, G), (state, G)), (), sizes.dequant_transient(j))


def _state_store(j, m, tensor, src, dst, save, sizes) -> Effects:
    """... back to the host store, which the next load of the block copies."""
    G, H = _GPU_TIER, _HOST_TIER
    params, state = tensor_id(_PARAMS, j), tensor_id(_OPT_STATE, j)
    return Effects(((params, G), (state, G)), (), ((state, G),), mutates=((params, H), (state, H)))


def _state_read(j, m, tensor, src, dst, save, sizes) -> Effects:
    """A host copy of state kept on NVMe, from its file (which stays)."""
    return Effects(((tensor, _NVME_TIER),), ((tensor, _HOST_TIER),), ())


def _state_write(j, m, tensor, src, dst, save, sizes) -> Effects:
    """The host copy back into its file, in place (the host copy stays until its ``free``)."""
    return Effects(((tensor, _HOST_TIER),), (), (), mutates=((tensor, _NVME_TIER),))


#: what one kind's op touches, from the op's fields after its kind (``effects_of``'s arguments)
EffectsFn = Callable[[int, "int | None", "TensorId | None", "Tier | None", "Tier | None", bool, Sizes], Effects]

#: each kind's effects: the column of the op registry (``ir.kinds``) that ``effects_of`` reads
EFFECTS: dict[OpKind, EffectsFn] = {
    OpKind.LOAD: _load, OpKind.COMPUTE: _compute, OpKind.RECOMPUTE: _recompute, OpKind.BACKWARD: _backward,
    OpKind.OFFLOAD: _copy, OpKind.RELOAD: _copy, OpKind.GRAD_OFFLOAD: _grad_offload, OpKind.UPDATE: _update,
    OpKind.STATE_LOAD: _state_load, OpKind.STATE_STORE: _state_store, OpKind.FREE: _free,
    OpKind.ALL_GATHER: _all_gather, OpKind.REDUCE_SCATTER: _reduce_scatter, OpKind.ALL_REDUCE: _all_reduce,
    OpKind.STATE_READ: _state_read, OpKind.STATE_WRITE: _state_write,
}
