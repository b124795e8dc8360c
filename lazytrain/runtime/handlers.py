"""One handler per op kind, and the small context they share (``Ctx``).

Every value the plan names lives in ``Ctx.copies[(TensorId, Tier)]``, one entry per copy, exactly
as ``ir.semantics.effects`` describes: an op adds the copies it writes and removes the ones it
drops, so a plan that ``verify`` accepts leaves ``copies`` as it found it (the batch on the host).

Payloads:

- ``params[j]`` on the GPU: ``GpuParams`` (one flat buffer, parameters are views into it);
- ``grads[j]`` on the GPU: the block's flat fp32 accumulator (host copies: ``HostStore.grad``);
- ``act[i] mb``: ``{value name: tensor}`` (the values live at boundary i);
- ``dact[i] mb``: ``{value name: gradient}`` for the values at boundary i that need one;
- ``saved[j] mb``: ``{key: tensor}``, the storages autograd saved for block j's backward, captured
  by ``saved_tensors_hooks`` (so they can move to the host or NVMe and back; the autograd graph
  itself keeps only keys, see ``SavedRecord``).

On the host a tensor is a typed view of a pooled byte buffer (``HostPool``), on NVMe an
``NvmeFile`` plus dtype and shape.  Tensors that live on another device than the compute device
(a CPU scalar saved by a GPU kernel) stay where they are when their payload moves.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from ..ir import Op, OpKind, Resource, TensorId, TensorKind, Tier
from .nvme import NvmeFile
from .rng import replaying, rng_state
from .streams import Streams

G, H, N = Tier.GPU, Tier.HOST, Tier.NVME


def _tid(kind: TensorKind, index: int, mb: int | None = None) -> TensorId:
    return TensorId(kind=kind, index=index, mb=mb)


@dataclass
class GpuParams:
    flat: torch.Tensor
    views: dict[str, torch.Tensor]
    #: other buffers the views point into (a resident block's tied links: its owner's buffer)
    extra: tuple[torch.Tensor, ...] = ()

    @property
    def flats(self) -> tuple[torch.Tensor, ...]:
        return (self.flat, *self.extra)


@dataclass
class HostCopy:
    buf: torch.Tensor            # pooled uint8 buffer
    tensor: torch.Tensor         # typed view of it


@dataclass
class NvmeCopy:
    file: NvmeFile
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class SavedRecord:
    """What backward of block j, micro-batch m needs besides the saved storages.

    ``roots``: (output name, gradient edge, shape, dtype) of every output that needs a gradient;
    ``direct``: outputs that are an input unchanged (their gradient goes straight to the input);
    ``leaves``/``params``: the leaf tensors whose gradients backward returns.  Leaves keep their
    autograd identity but their data is swapped for a zero-stride scalar after the forward
    (``_release``), so the graph holds no activation or parameter memory of its own: every byte
    backward reads is in ``copies[saved[j] mb]`` (moved by offload/reload) or the loaded params.
    """

    block: int
    roots: list = field(default_factory=list)
    direct: dict[str, str] = field(default_factory=dict)
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict | None = None          # set for the duration of backward
    param_flats: tuple[torch.Tensor, ...] | None = None


@dataclass
class Ctx:
    """Runtime state of one trainer: fixed parts (plan, program, store, ...) and per-step parts."""

    plan: object
    program: object
    device: torch.device
    streams: Streams
    store: object                         # HostStore
    pool: object                          # HostPool
    nvme: object                          # NvmeStore
    optimizer: object                     # HostOptimizer
    tracker: object                       # GradNormTracker
    lagged: dict[int, bool]               # block -> its update applies last step's gradients
    norm_first: bool                      # every update waits for the global norm
    requires_grad: set[str]               # value names that carry gradients
    #: parameters with requires_grad=False: no gradient is taken for them, so their accumulator slice
    #: stays zero and (without weight decay) the update leaves them as they are
    frozen: frozenset = frozenset()
    profiler: object | None = None
    schedule: object | None = None        # interpreter.Schedule of the plan (built on first run)
    deps: object = None                   # op id -> the deps it waits for (plan deps + hazards)
    # per step
    copies: dict = field(default_factory=dict)
    saved_rec: dict = field(default_factory=dict)
    done: dict = field(default_factory=dict)
    grad_sq: dict = field(default_factory=dict)
    loss_parts: dict = field(default_factory=dict)
    rng_states: dict = field(default_factory=dict)  # (block, mb) -> generator state before its forward
    inv_tokens: torch.Tensor | None = None
    coef: float | None = None
    norm_done: bool = False
    # across steps
    pending: set = field(default_factory=set)      # blocks whose last-step gradients await a lagged update
    pending_coef: float | None = None
    step_lr: float | None = None                   # the optimizer's lr when this step began
    pending_lr: float | None = None                # ... when the step of the pending gradients began
    update_futures: dict = field(default_factory=dict)
    #: resident blocks (``Decisions.resident``): parameters on the GPU for the whole run, and per
    #: parameter name the slice of its owner's fp32 GPU accumulator that backward adds into
    resident: dict = field(default_factory=dict)
    resident_grad: dict = field(default_factory=dict)      # owner block -> fp32 accumulator
    resident_targets: dict = field(default_factory=dict)   # block -> {param name: accumulator slice}
    tied_grad: dict = field(default_factory=dict)  # owner block -> fp32 buffer for its assembled gradient
    tied_ready: set = field(default_factory=set)   # owners whose buffer holds the gradient their update needs
    host_pool: object | None = None                # threads of the tied-gradient sum (made on first use)

    @property
    def L(self) -> int:
        return self.plan.graph.n_blocks

    @property
    def cuda(self) -> bool:
        return self.streams.cuda

    # ---- op bracketing -----------------------------------------------------------------------
    def begin(self, op: Op, res: Resource) -> None:
        """Make ``res`` wait for the op's dependencies, then mark the start (profiling)."""
        self.streams.wait_on_stream(res, self.dep_handles(op))
        if self.profiler is not None:
            self.profiler.start(op, self.streams.stream(res))

    def end(self, op: Op, res: Resource) -> None:
        ev = self.streams.record(res)
        self.done[op.id] = ev
        if self.profiler is not None:
            self.profiler.stop(op, self.streams.stream(res))

    def dep_handles(self, op: Op) -> list:
        deps = self.deps
        ids = deps[op.id] if deps is not None and 0 <= op.id < len(deps) else op.deps
        return [self.done.get(d) for d in ids]

    def submit(self, pool, op: Op, fn) -> None:
        """Run ``fn`` on a host worker after the op's dependencies (waited for in the worker)."""
        handles = self.dep_handles(op)
        prof = self.profiler

        def work():
            Streams.wait_on_host(handles)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:
                raise RuntimeError(f"while executing op #{op.id} ({describe(op)}): {e}") from e
            if prof is not None:
                prof.host_interval(op, t0, time.perf_counter())
        self.done[op.id] = pool.submit(work)

    def take(self, t: TensorId, tier: Tier):
        try:
            return self.copies.pop((t, tier))
        except KeyError:
            raise KeyError(f"{t} is not resident on {tier.value}") from None

    def get(self, t: TensorId, tier: Tier):
        try:
            return self.copies[(t, tier)]
        except KeyError:
            raise KeyError(f"{t} is not resident on {tier.value}") from None

    def put(self, t: TensorId, tier: Tier, payload) -> None:
        self.copies[(t, tier)] = payload

    def params(self, j: int):
        """Block j's parameters on the GPU: resident, or the loaded copy."""
        p = self.resident.get(j)
        return p if p is not None else self.get(_tid(TensorKind.PARAMS, j), G)


def describe(op: Op) -> str:
    return " ".join(str(op).split()[1:])


# ---- parameters ---------------------------------------------------------------------------------
def load(ctx: Ctx, op: Op) -> None:
    j = op.block
    lay = ctx.store.layouts[j]
    for owner in {o for _, o, _ in lay.links} | {j}:     # the updates writing these host buffers: the
        fut = ctx.update_futures.get(owner)               # dispatcher issues a load once they are done,
        if fut is not None:                               # so this only re-raises a failed update
            fut.result()
    ctx.begin(op, Resource.H2D)
    with ctx.streams.on(Resource.H2D):
        flat = torch.empty(lay.numel, dtype=ctx.store.param_dtype, device=ctx.device)
        flat[:lay.owned_numel].copy_(ctx.store.load[j], non_blocking=True)
        for seg, owner, off in lay.links:
            flat[seg.offset:seg.offset + seg.numel].copy_(ctx.store.load[owner][off:off + seg.numel],
                                                          non_blocking=True)
    ctx.streams.keep_alive(flat, Resource.GPU)
    views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in lay.segments}
    ctx.put(op.tensor or _tid(TensorKind.PARAMS, j), G, GpuParams(flat, views))
    ctx.end(op, Resource.H2D)


# ---- forward ------------------------------------------------------------------------------------
_ZERO: dict = {}


def _release(t: torch.Tensor) -> None:
    """Drop a leaf's memory but keep its autograd identity and shape (see ``SavedRecord``)."""
    key = (t.dtype, t.device)
    z = _ZERO.get(key)
    if z is None:
        z = _ZERO[key] = torch.zeros((), dtype=t.dtype, device=t.device)
    t.data = z.expand(t.shape)


def _hooks(rec: SavedRecord, entries: dict, param_flats: tuple[torch.Tensor, ...]):
    """Pack every tensor autograd saves into ``entries`` (deduplicated by storage), or, for views of
    the block's parameter buffers, into a reference that unpacks to whatever buffer is loaded then."""
    pstores = {f.untyped_storage().data_ptr(): i for i, f in enumerate(param_flats)}
    device = param_flats[0].device
    by_ptr: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        i = pstores.get(ptr)
        if i is not None and t.device == device:
            return ("param", i, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if t.layout is not torch.strided or ptr == 0:
            k = len(entries)
            entries[k] = t
            return ("whole", k)
        k = by_ptr.get(ptr)
        if k is None:
            k = by_ptr[ptr] = len(entries)
            entries[k] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        return ("view", k, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(h):
        if h[0] == "param":
            if rec.param_flats is None:
                raise RuntimeError(f"block {rec.block}'s parameters are not loaded for its backward")
            _, i, dt, shape, stride, off = h
            return rec.param_flats[i].view(dt).as_strided(shape, stride, off)
        if rec.entries is None:
            raise RuntimeError(f"saved[{rec.block}] is not on the GPU for its backward")
        if h[0] == "whole":
            return rec.entries[h[1]]
        _, k, dt, shape, stride, off = h
        return rec.entries[k].view(dt).as_strided(shape, stride, off)

    return saved_tensors_hooks(pack, unpack)


def _forward(ctx: Ctx, op: Op, save: bool) -> None:
    j, mb = op.block, op.mb
    L = ctx.L
    ctx.begin(op, Resource.GPU)
    params: GpuParams = ctx.params(j)
    a_in: dict = ctx.get(_tid(TensorKind.ACT, j, mb), G)
    prog = ctx.program
    with ctx.streams.on(Resource.GPU), _random_draws(ctx, op):
        if not save:
            with torch.no_grad():
                out = prog.run_block(j, params.views, a_in)
        else:
            rec = SavedRecord(block=j)
            rec.params = {n: v.detach().requires_grad_(n not in ctx.frozen) for n, v in params.views.items()}
            rec.leaves = {n: v.detach().requires_grad_() for n, v in a_in.items()
                          if n in ctx.requires_grad and isinstance(v, torch.Tensor) and v.is_floating_point()}
            entries: dict = {}
            with torch.enable_grad(), _hooks(rec, entries, params.flats):
                out = prog.run_block(j, rec.params, {**a_in, **rec.leaves})
            by_id = {id(v): n for n, v in rec.leaves.items()}
            for name, t in out.items():
                if not isinstance(t, torch.Tensor) or not t.requires_grad:
                    continue
                if t.grad_fn is None:
                    if id(t) in by_id:
                        rec.direct[name] = by_id[id(t)]
                    continue
                rec.roots.append((name, get_gradient_edge(t), tuple(t.shape), t.dtype))
        out = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in out.items()}
        if save:       # after detaching: an output may be an input leaf passed through unchanged
            for t in (*rec.params.values(), *rec.leaves.values()):
                _release(t)
            # autograd keeps the pack hook (and so its closure) with every saved tensor until the
            # backward: the copy goes to the residency table, the hook's own dict is emptied, else an
            # offloaded saved[j] would stay on the GPU, pinned by the graph (7B OOM, 10 GiB over plan)
            ctx.put(_tid(TensorKind.SAVED, j, mb), G, dict(entries))
            entries.clear()
            ctx.saved_rec[(j, mb)] = rec
    if j == L - 1 and op.kind is OpKind.COMPUTE:
        ctx.loss_parts[mb] = (out["loss_sum"], out["n_tokens"])
    writes_act = j + 1 < L and (op.kind is OpKind.COMPUTE or op.tensor is None or op.tensor.kind is TensorKind.ACT)
    if writes_act:
        names = ctx.program.graph.boundary_values[j + 1] if ctx.program.graph.boundary_values else tuple(
            {**a_in, **out})
        nxt = {}
        for n in names:
            if n in out:
                nxt[n] = out[n]
            elif n in a_in:
                nxt[n] = a_in[n]
            else:
                raise KeyError(f"boundary {j + 1} value {n!r} is neither an output of block {j} nor live before it")
        ctx.put(_tid(TensorKind.ACT, j + 1, mb), G, nxt)
    ctx.end(op, Resource.GPU)


def _random_draws(ctx: Ctx, op: Op):
    """A block that draws random numbers: its forward records the generator state, its
    recomputation replays from it (``rng``)."""
    if not ctx.program.blocks[op.block].random:
        return contextlib.nullcontext()
    key = (op.block, op.mb)
    if op.kind is OpKind.COMPUTE:
        ctx.rng_states[key] = rng_state(ctx.device)
        return contextlib.nullcontext()
    if key not in ctx.rng_states:
        raise RuntimeError(f"recompute of block {op.block} mb{op.mb} before its forward: no random state to replay")
    return replaying(ctx.device, ctx.rng_states[key])


def compute(ctx: Ctx, op: Op) -> None:
    _forward(ctx, op, op.save)


def recompute(ctx: Ctx, op: Op) -> None:
    _forward(ctx, op, True)


# ---- backward -----------------------------------------------------------------------------------
def _inv_tokens(ctx: Ctx) -> torch.Tensor:
    """1 / (valid tokens of the whole batch): the head's output gradient, so that the summed
    micro-batch losses give the gradient of the batch's mean loss (what eager training computes)."""
    if ctx.inv_tokens is None:
        if len(ctx.loss_parts) != ctx.plan.n_micro:
            raise RuntimeError("the head's backward runs before the forward of every micro-batch")
        total = sum(n for _, n in ctx.loss_parts.values())
        loss_dtype = next(iter(ctx.loss_parts.values()))[0].dtype
        ctx.inv_tokens = (1.0 / torch.as_tensor(total, dtype=torch.float64).clamp_min(1)).to(loss_dtype)
    return ctx.inv_tokens


def backward(ctx: Ctx, op: Op) -> None:
    j, mb = op.block, op.mb
    L = ctx.L
    ctx.begin(op, Resource.GPU)
    rec: SavedRecord = ctx.saved_rec.pop((j, mb))
    rec.entries = ctx.take(_tid(TensorKind.SAVED, j, mb), G)
    params: GpuParams = ctx.params(j)
    rec.param_flats = params.flats
    dout = ctx.take(_tid(TensorKind.GRAD_ACT, j + 1, mb), G) if j + 1 < L else {}
    lay = ctx.store.layouts[j]
    with ctx.streams.on(Resource.GPU):
        roots, grads = [], []
        for name, edge, _, dtype in rec.roots:
            if j == L - 1 and name == "loss_sum":
                roots.append(edge)
                grads.append(_inv_tokens(ctx).to(device=ctx.device, dtype=dtype).reshape(()))
            elif name in dout:
                roots.append(edge)
                grads.append(dout[name])
        pnames = [n for n, v in rec.params.items() if v.requires_grad]
        lnames = list(rec.leaves)
        wrt = [rec.params[n] for n in pnames] + [rec.leaves[n] for n in lnames]
        res = torch.autograd.grad(roots, wrt, grads, allow_unused=True) if roots else [None] * len(wrt)
        rec.entries = rec.param_flats = None
        targets = ctx.resident_targets.get(j)
        if targets is None:
            key = _tid(TensorKind.GRADS, j)
            acc = ctx.copies.get((key, G))
            if acc is None:
                acc = torch.zeros(lay.numel, dtype=torch.float32, device=ctx.device)
                ctx.put(key, G, acc)
            targets = {s.name: acc[s.offset:s.offset + s.numel] for s in lay.segments}
        for n, g in zip(pnames, res[:len(pnames)]):
            if g is not None:
                targets[n].add_(g.reshape(-1))
        if j > 0:
            here = set(ctx.program.graph.boundary_values[j]) if ctx.program.graph.boundary_values else None
            produced = {name for name, *_ in rec.roots} | set(rec.direct)
            dact = {n: g for n, g in dout.items() if n not in produced and (here is None or n in here)}
            in_grads = dict(zip(lnames, res[len(pnames):]))
            for out_name, in_name in rec.direct.items():
                if out_name in dout:
                    g0 = in_grads.get(in_name)
                    in_grads[in_name] = dout[out_name] if g0 is None else g0 + dout[out_name]
            for n, g in in_grads.items():
                if g is not None:
                    dact[n] = g if n not in dact else dact[n] + g
            ctx.put(_tid(TensorKind.GRAD_ACT, j, mb), G, dact)
    ctx.end(op, Resource.GPU)


# ---- activations --------------------------------------------------------------------------------
def _to_host(ctx: Ctx, v):
    if not isinstance(v, torch.Tensor) or (ctx.cuda and v.device.type != "cuda"):
        return v
    src = v if v.is_contiguous() else v.contiguous()
    nbytes = src.numel() * src.element_size()
    buf = ctx.pool.acquire(nbytes)
    typed = buf.view(src.dtype).view(src.shape)
    ctx.streams.keep_alive(v, Resource.D2H)
    typed.copy_(src, non_blocking=True)
    return HostCopy(buf, typed)


def _to_gpu(ctx: Ctx, v):
    if not isinstance(v, HostCopy):
        return v
    g = torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device=ctx.device)
    g.copy_(v.tensor, non_blocking=True)
    ctx.streams.keep_alive(g, Resource.GPU)
    return g


def _tag(t: TensorId, k) -> str:
    return f"{t.kind.value}{t.index}_mb{t.mb}_{k}"


def offload(ctx: Ctx, op: Op) -> None:
    t = op.tensor
    if op.src is G and op.dst is H:
        ctx.begin(op, Resource.D2H)
        payload = ctx.get(t, G)
        with ctx.streams.on(Resource.D2H):
            ctx.put(t, H, {k: _to_host(ctx, v) for k, v in payload.items()})
        ctx.end(op, Resource.D2H)
    elif op.src is H and op.dst is N:
        payload = ctx.get(t, H)
        files = {k: (NvmeCopy(NvmeFile(ctx.nvme.path(_tag(t, k)), v.buf.numel()), v.tensor.dtype,
                              tuple(v.tensor.shape)) if isinstance(v, HostCopy) else v) for k, v in payload.items()}

        def write():
            for k, v in payload.items():
                if isinstance(v, HostCopy):
                    ctx.nvme.write(_tag(t, k), v.buf)
        ctx.submit(ctx.streams.nvme, op, write)
        ctx.put(t, N, files)
    else:
        raise ValueError(f"offload {op.src} -> {op.dst} is not a move this runtime knows")


def reload(ctx: Ctx, op: Op) -> None:
    t = op.tensor
    if op.src is H and op.dst is G:
        ctx.begin(op, Resource.H2D)
        payload = ctx.get(t, H)
        with ctx.streams.on(Resource.H2D):
            ctx.put(t, G, {k: _to_gpu(ctx, v) for k, v in payload.items()})
        ctx.end(op, Resource.H2D)
    elif op.src is N and op.dst is H:
        files = ctx.get(t, N)
        host = {}
        for k, v in files.items():
            if isinstance(v, NvmeCopy):
                buf = ctx.pool.acquire(v.file.nbytes)
                host[k] = HostCopy(buf, buf.view(v.dtype).view(v.shape))
            else:
                host[k] = v

        def read():
            for k, v in files.items():
                if isinstance(v, NvmeCopy):
                    ctx.nvme.read(v.file, host[k].buf)
        ctx.submit(ctx.streams.nvme, op, read)
        ctx.put(t, H, host)
    else:
        raise ValueError(f"reload {op.src} -> {op.dst} is not a move this runtime knows")


def free(ctx: Ctx, op: Op) -> None:
    """Drop one copy.  GPU memory: the last reader on another stream was recorded with
    ``record_stream``, so the allocator reuses it only after that read; host buffers go back to the
    pool with the readers' completion handles; files are deleted by the NVMe worker after its reads."""
    payload = ctx.take(op.tensor, op.src)
    if op.src is H:
        after = ctx.dep_handles(op)
        for v in payload.values():
            if isinstance(v, HostCopy):
                ctx.pool.release(v.buf, after)
    elif op.src is N:
        def delete():
            for v in payload.values():
                if isinstance(v, NvmeCopy):
                    ctx.nvme.delete(v.file)
        ctx.submit(ctx.streams.nvme, op, delete)
        return
    ctx.done[op.id] = None
