"""One handler per op kind; the state they share is ``context.Run`` (fixed for the run) and
``context.Step`` (one step's), and the update path's is ``updates.Updates``.

Every value the plan names lives in ``Step.copies[(TensorId, Tier)]``, one entry per copy, exactly
as ``ir.semantics.effects`` describes: an op adds the copies it writes and removes the ones it
drops, so a plan that ``verify`` accepts leaves ``copies`` as it found it (the batch on the host).

``offload`` and ``reload`` are one handler, ``copy``, which runs the copy of ``COPIES`` its (source, destination)
tiers name; ``free`` drops a copy as its tier's entry of ``FREES`` does (``ir.tiers`` is the tier table).

Payloads:

- ``params[j]`` on the GPU: ``GpuParams`` (one flat buffer, parameters are views into it);
- ``grads[j]`` on the GPU: the block's flat fp32 accumulator (host copies: ``HostStore.grad``);
- ``act[i] mb``: ``{value name: tensor}`` (the values live at boundary i);
- ``dact[i] mb``: ``{value name: gradient}`` for the values at boundary i that need one;
- ``saved[j] mb``: ``{key: tensor}``, the storages saved for block j's backward: captured by
  ``saved_tensors_hooks`` for an eager block, the saved list its compiled forward returns for a compiled one
  (so they can move to the host or NVMe and back; the autograd graph or the record itself keeps only keys,
  see ``saved.SavedRecord``).

On the host a tensor is a typed view of a pooled byte buffer (``HostPool``), on NVMe an
``NvmeFile`` plus dtype and shape.  Tensors that live on another device than the compute device
(a CPU scalar saved by a GPU kernel) stay where they are when their payload moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.autograd.graph import get_gradient_edge

from ..ir import Op, OpKind, Resource, TensorId, TensorKind, Tier
from ..ir.ops import tensor_id
from ..ir.tiers import COPIES as TIER_COPIES
from . import compiled_block
from .context import G, GpuParams, H, N, NvmeCopy, Payload, Step
from .nvme import NvmeFile
from .rng import replaying, rng_state
from .saved import Packer, SavedRecord
from .store import HostCopy


# ---- parameters ---------------------------------------------------------------------------------
def load(ctx: Step, op: Op) -> None:
    """Block j's parameters host -> GPU: with several ranks its shard (``pshard[j]``), which an
    ``all_gather`` completes."""
    j = op.block
    run = ctx.run
    ctx.begin(op, Resource.H2D)       # after the updates writing these host buffers (re-raises a failed one)
    owned = run.store.load
    if run.nvme_state is not None and run.nvme_state.has(TensorKind.PARAMS, j):    # the host copy state_read made
        owned = {j: ctx.get(tensor_id(TensorKind.PARAMS, j), H)["buf"].tensor}
    with run.streams.on(Resource.H2D):
        flat = assemble(run.store.layouts[j], owned, run.device, run.store.param_dtype, run.store)
    if op.tensor is not None and op.tensor.kind is TensorKind.PARAM_SHARD:
        run.streams.keep_alive(flat, Resource.NET)
        ctx.put(op.tensor, G, flat)
    else:
        run.streams.keep_alive(flat, Resource.GPU)
        views = {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in run.store.layouts[j].segments}
        ctx.put(op.tensor or tensor_id(TensorKind.PARAMS, j), G, GpuParams(flat, views))
    ctx.end(op, Resource.H2D)


def assemble(lay, owned, device: torch.device, dtype: torch.dtype, store=None) -> torch.Tensor:
    """A block's flat parameters (or, with several ranks, its shard) on ``device``: its owned part from
    ``owned[j]``, each tied link from its owner's ``owned[o]``, so the host keeps one copy of a tied weight.

    Where ``store`` holds the block's frozen segment quantized (``HostStore.quant``), ``owned[j]`` is the trainable
    prefix alone: the packed bytes cross into a staging buffer and are dequantized into the block's frozen views,
    on the current (copy) stream, so the block's compute waits for them as for the copy (the plan prices the
    staging and the dequantization's temporaries as the load's transient, ``Sizes.dequant_transient``)."""
    flat = torch.empty(lay.numel, dtype=dtype, device=device)
    q = None if store is None else store.quant.get(lay.index)
    if q is None:
        flat[:lay.owned_numel].copy_(owned[lay.index], non_blocking=True)
    else:
        flat[:lay.trainable_numel].copy_(owned[lay.index], non_blocking=True)
        staged = torch.empty(q.nbytes, dtype=torch.uint8, device=device)
        staged.copy_(store.packed[lay.index], non_blocking=True)
        q.dequantize_into(flat[lay.trainable_numel:lay.owned_numel], q.views(staged))
    for seg, owner, off in lay.links:
        src = owned[owner][off:off + seg.numel] if store is None or owner not in store.quant else \
            store.link_source(owner, off, seg.numel)          # (a packed owner: its raw section)
        flat[seg.offset:seg.offset + seg.numel].copy_(src, non_blocking=True)
    return flat


# ---- forward ------------------------------------------------------------------------------------
_ZERO: dict = {}


def _release(t: torch.Tensor) -> None:
    """Drop a leaf's memory but keep its autograd identity and shape (see ``SavedRecord``)."""
    key = (t.dtype, t.device)
    z = _ZERO.get(key)
    if z is None:
        z = _ZERO[key] = torch.zeros((), dtype=t.dtype, device=t.device)
    t.data = z.expand(t.shape)


def _forward(ctx: Step, op: Op, save: bool) -> None:
    j, mb = op.block, op.mb
    L = ctx.run.L
    ctx.begin(op, Resource.GPU)
    params: GpuParams = ctx.params(j)
    a_in: dict = ctx.get(tensor_id(TensorKind.ACT, j, mb), G)
    prog = ctx.run.program
    cb = prog.compiled.get(j)
    with ctx.run.streams.on(Resource.GPU), _random_draws(ctx, op):
        if cb is not None and (save or cb.infer is not None):
            out, rec, entries = compiled_block.forward(ctx, j, cb, params, a_in, save)
        elif not save:
            with torch.no_grad():
                out = prog.run_block(j, params.views, a_in)
        else:
            out, rec, entries = _eager_forward(ctx, j, params, a_in)
        if save:
            # the copy goes to the residency table; an eager block's pack hook (kept by autograd with every
            # saved tensor until the backward) has its own dict emptied, so an offloaded saved[j] holds no GPU
            # memory through the graph (each one would: 10 GiB on a 7B plan)
            ctx.put(tensor_id(TensorKind.SAVED, j, mb), G, dict(entries))
            entries.clear()
            ctx.saved_rec[(j, mb)] = rec
    if j == L - 1 and op.kind is OpKind.COMPUTE:
        ctx.loss_parts[mb] = (out["loss_sum"], out["n_tokens"])
    writes_act = j + 1 < L and (op.kind is OpKind.COMPUTE or op.tensor is None or op.tensor.kind is TensorKind.ACT)
    if writes_act:
        names = ctx.run.program.graph.boundary_values[j + 1] if ctx.run.program.graph.boundary_values else tuple(
            {**a_in, **out})
        nxt = {}
        for n in names:
            if n in out:
                nxt[n] = out[n]
            elif n in a_in:
                nxt[n] = a_in[n]
            else:
                raise KeyError(f"boundary {j + 1} value {n!r} is neither an output of block {j} nor live before it")
        ctx.put(tensor_id(TensorKind.ACT, j + 1, mb), G, nxt)
    ctx.end(op, Resource.GPU)


def _eager_forward(ctx: Step, j: int, params: GpuParams, a_in: dict) -> tuple[dict, SavedRecord, dict]:
    """Block j's program under autograd, every saved tensor packed into the returned entries; outputs detached."""
    rec = SavedRecord(block=j)
    rec.params = {n: v.detach().requires_grad_(n not in ctx.run.frozen) for n, v in params.views.items()}
    rec.leaves = {n: v.detach().requires_grad_() for n, v in a_in.items()
                  if n in ctx.run.requires_grad and isinstance(v, torch.Tensor) and v.is_floating_point()}
    entries: dict = {}
    with torch.enable_grad(), Packer(rec, entries, params.flats).hooks():
        out = ctx.run.program.run_block(j, rec.params, {**a_in, **rec.leaves})
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
    for t in (*rec.params.values(), *rec.leaves.values()):     # after detaching: an output may be an input leaf
        _release(t)
    return out, rec, entries


def _random_draws(ctx: Step, op: Op):
    """A block that draws random numbers: its forward records the generator state, its
    recomputation replays from it (``rng``)."""
    if not ctx.run.program.blocks[op.block].random:
        return contextlib.nullcontext()
    key = (op.block, op.mb)
    if op.kind is OpKind.COMPUTE:
        ctx.rng_states[key] = rng_state(ctx.run.device)
        return contextlib.nullcontext()
    if key not in ctx.rng_states:
        raise RuntimeError(f"recompute of block {op.block} mb{op.mb} before its forward: no random state to replay")
    return replaying(ctx.run.device, ctx.rng_states[key])


def compute(ctx: Step, op: Op) -> None:
    _forward(ctx, op, op.save)


def recompute(ctx: Step, op: Op) -> None:
    _forward(ctx, op, True)


# ---- backward -----------------------------------------------------------------------------------
def _inv_tokens(ctx: Step) -> torch.Tensor:
    """1 / (valid tokens of the whole batch): the head's output gradient, so that the summed
    micro-batch losses give the gradient of the batch's mean loss (what eager training computes)."""
    if ctx.inv_tokens is None:
        if len(ctx.loss_parts) != ctx.run.plan.n_micro:
            raise RuntimeError("the head's backward runs before the forward of every micro-batch")
        total = sum(n for _, n in ctx.loss_parts.values())
        loss_dtype = next(iter(ctx.loss_parts.values()))[0].dtype
        ctx.inv_tokens = (1.0 / torch.as_tensor(total, dtype=torch.float64).clamp_min(1)).to(loss_dtype)
    return ctx.inv_tokens


def _eager_gradients(ctx: Step, rec: SavedRecord, dout: dict) -> tuple[list[str], list[str], list]:
    """(trained parameter names, input leaf names, their gradients) of an eager block's saved graph."""
    roots, grads = [], []
    for name, edge, _, dtype in rec.roots:
        if rec.block == ctx.run.L - 1 and name == "loss_sum":
            roots.append(edge)
            grads.append(_inv_tokens(ctx).to(device=ctx.run.device, dtype=dtype).reshape(()))
        elif name in dout:
            roots.append(edge)
            grads.append(dout[name])
    pnames = [n for n, v in rec.params.items() if v.requires_grad]
    lnames = list(rec.leaves)
    wrt = [rec.params[n] for n in pnames] + [rec.leaves[n] for n in lnames]
    res = torch.autograd.grad(roots, wrt, grads, allow_unused=True) if roots else [None] * len(wrt)
    return pnames, lnames, res


def backward(ctx: Step, op: Op) -> None:
    j, mb = op.block, op.mb
    L = ctx.run.L
    ctx.begin(op, Resource.GPU)
    rec: SavedRecord = ctx.saved_rec.pop((j, mb))
    rec.entries = ctx.take(tensor_id(TensorKind.SAVED, j, mb), G)
    params: GpuParams = ctx.params(j)
    rec.param_flats = params.flats
    dout = ctx.take(tensor_id(TensorKind.GRAD_ACT, j + 1, mb), G) if j + 1 < L else {}
    lay = ctx.run.gpu_layouts[j] if ctx.run.gpu_layouts else ctx.run.store.layouts[j]
    with ctx.run.streams.on(Resource.GPU):
        if rec.handles is not None:
            pnames, lnames, res = compiled_block.gradients(ctx, rec, dout)
        else:
            pnames, lnames, res = _eager_gradients(ctx, rec, dout)
        rec.entries = rec.param_flats = None
        targets = ctx.run.resident_targets.get(j)
        if targets is None:
            key = tensor_id(TensorKind.GRADS, j)
            acc = ctx.copies.get((key, G))
            if acc is None:
                acc = torch.zeros(lay.grad_numel, dtype=torch.float32, device=ctx.run.device)
                ctx.put(key, G, acc)      # (of the trainable prefix: a frozen parameter has no gradient)
            targets = {s.name: acc[s.offset:s.offset + s.numel] for s in lay.segments if s.offset < lay.grad_numel}
        for n, g in zip(pnames, res[:len(pnames)]):
            if g is not None:
                targets[n].add_(g.reshape(-1))
        if j > 0:
            here = set(ctx.run.program.graph.boundary_values[j]) if ctx.run.program.graph.boundary_values else None
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
            ctx.put(tensor_id(TensorKind.GRAD_ACT, j, mb), G, dact)
    ctx.end(op, Resource.GPU)


# ---- activations --------------------------------------------------------------------------------
def _to_host(ctx: Step, v):
    if not isinstance(v, torch.Tensor) or (ctx.run.cuda and v.device.type != "cuda"):
        return v
    src = v if v.is_contiguous() else v.contiguous()
    nbytes = src.numel() * src.element_size()
    buf = ctx.run.pool.acquire(nbytes)
    typed = buf.view(src.dtype).view(src.shape)
    ctx.run.streams.keep_alive(v, Resource.D2H)
    typed.copy_(src, non_blocking=True)
    return HostCopy(buf, typed)


def _to_gpu(ctx: Step, v):
    if not isinstance(v, HostCopy):
        return v
    g = torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device=ctx.run.device)
    g.copy_(v.tensor, non_blocking=True)
    ctx.run.streams.keep_alive(g, Resource.GPU)
    return g


def _tag(t: TensorId, k) -> str:
    return f"{t.kind.value}{t.index}_mb{t.mb}_{k}"


def _over_pcie(resource: Resource, convert: Callable) -> Callable[[Step, Op], None]:
    """The copy of a value between the GPU and the host on the copy stream ``resource``: each of its tensors
    converted by ``convert(ctx, tensor)`` (``_to_host``, ``_to_gpu``) on that stream."""
    def copy_on_stream(ctx: Step, op: Op) -> None:
        ctx.begin(op, resource)
        payload = ctx.get(op.tensor, op.src)
        with ctx.run.streams.on(resource):
            ctx.put(op.tensor, op.dst, {k: convert(ctx, v) for k, v in payload.items()})
        ctx.end(op, resource)
    return copy_on_stream


def _host_to_nvme(ctx: Step, op: Op) -> None:
    t = op.tensor
    payload = ctx.get(t, H)
    files = {k: (NvmeCopy(NvmeFile(ctx.run.nvme.path(_tag(t, k)), v.buf.numel()), v.tensor.dtype,
                          tuple(v.tensor.shape)) if isinstance(v, HostCopy) else v) for k, v in payload.items()}

    def write():
        for k, v in payload.items():
            if isinstance(v, HostCopy):
                ctx.run.nvme.write(_tag(t, k), v.buf)
    ctx.submit(ctx.run.streams.nvme, op, write)
    ctx.put(t, N, files)


def _nvme_to_host(ctx: Step, op: Op) -> None:
    t = op.tensor
    files = ctx.get(t, N)
    host = {}
    for k, v in files.items():
        if isinstance(v, NvmeCopy):
            buf = ctx.run.pool.acquire(v.file.nbytes)
            host[k] = HostCopy(buf, buf.view(v.dtype).view(v.shape))
        else:
            host[k] = v

    def read():
        for k, v in files.items():
            if isinstance(v, NvmeCopy):
                ctx.run.nvme.read(v.file, host[k].buf)
    ctx.submit(ctx.run.streams.nvme, op, read)
    ctx.put(t, H, host)


#: the runtime's copy of a value from one tier to another, keyed by (source, destination): one per copy of
#: ``ir.tiers.COPIES`` (a test checks the two agree)
COPIES: dict[tuple[Tier, Tier], Callable[[Step, Op], None]] = {
    (G, H): _over_pcie(Resource.D2H, _to_host), (H, N): _host_to_nvme,
    (H, G): _over_pcie(Resource.H2D, _to_gpu), (N, H): _nvme_to_host}


def copy(ctx: Step, op: Op) -> None:
    """``offload`` and ``reload``: the copy its (source, destination) names, in the direction its kind says."""
    fn = COPIES.get((op.src, op.dst))
    c = TIER_COPIES.get((op.src, op.dst))
    if fn is None or c is None or c.kind is not op.kind:
        raise ValueError(f"{op.kind.value} {op.src} -> {op.dst} is not a move this runtime knows")
    fn(ctx, op)


def _free_gpu(ctx: Step, op: Op, payload) -> None:
    """GPU memory: the last reader on another stream was recorded with ``record_stream``, so the allocator reuses
    it only after that read."""
    ctx.done[op.id] = None


def _free_host(ctx: Step, op: Op, payload) -> None:
    """Host buffers go back to the pool with the readers' completion handles."""
    after = ctx.dep_handles(op)
    for v in payload.values():
        if isinstance(v, HostCopy):
            ctx.run.pool.release(v.buf, after)
    ctx.done[op.id] = None


def _free_nvme(ctx: Step, op: Op, payload) -> None:
    """Files are deleted by the NVMe worker after its reads."""
    def delete():
        for v in payload.values():
            if isinstance(v, NvmeCopy):
                ctx.run.nvme.delete(v.file)
    ctx.submit(ctx.run.streams.nvme, op, delete)


# ---- state kept on NVMe (``nvme_state.py``) ---------------------------------------------------------
def state_read(ctx: Step, op: Op) -> None:
    """A host copy of placed state from its file, in a pooled buffer, on the NVMe worker."""
    state, t = ctx.run.nvme_state, op.tensor
    payload = state.empty_copy(t.kind, op.block)
    ctx.submit(ctx.run.streams.nvme, op, lambda: state.read(t.kind, op.block, payload))
    ctx.put(t, H, payload)


def state_write(ctx: Step, op: Op) -> None:
    """A host copy of placed state back into its file, on the NVMe worker (the copy stays until its ``free``)."""
    state, t = ctx.run.nvme_state, op.tensor
    payload = ctx.get(t, H)
    ctx.submit(ctx.run.streams.nvme, op, lambda: state.write(t.kind, op.block, payload))


#: how a copy on each tier is dropped, keyed by tier (a test checks every tier has one)
FREES: dict[Tier, Callable[[Step, Op, Payload], None]] = {G: _free_gpu, H: _free_host, N: _free_nvme}


def free(ctx: Step, op: Op) -> None:
    """Drop one copy, as its tier does (``FREES``)."""
    FREES[op.src](ctx, op, ctx.take(op.tensor, op.src))
