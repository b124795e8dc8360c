"""Sequence tiling: a layer's position-wise tail runs in chunks of the sequence, recomputed in backward.

At long sequences one layer's own transients no longer fit: a 7B layer at 65,536 tokens saves 14.5 GiB
for its backward, 9 GiB of it the MLP's intermediates (four tensors of 65,536 x 18,944), whatever the
plan does between layers.  Every token goes through the part of a layer after attention -- output
projection, residual add, norm, MLP, residual add -- independently of the others, so that part can run
``ir.graph.TILE_TOKENS`` positions at a time: the forward keeps only the tail's inputs (the attention output and
the residual), and the backward recomputes one chunk's intermediates at a time, differentiates them, and
frees them (``_ChunkedTail``; the chunked loss of ``program.py`` does the same for the head's logits).
Mathematically the same function: each output row is computed from the same input row by the same ops.

The tail is found in the block's exported graph, from the end backwards: every node must be an op that
acts on each position alone (``POSITIONWISE``, with no reduction, split or concatenation along the batch
or sequence dimension), every activation it reads or writes must have the batch and sequence as its first
two dimensions (or both flattened into the first), and every shape it is given must be one that chunking
can rewrite.  The first node that fails ends the tail (attention's transposes do); a block whose tail has no
matmul, draws random numbers (a dropout would need its masks replayed) or reads a constant is left as it
is.  The trace measures the tiled program like any other (``trace._measure``): FLOPs gain the tail's
forward once more in backward, saved bytes lose its intermediates, and the workspace gains one chunk's
backward (its share of what the whole tail would save and of its largest op), plus fp32 accumulators for
the tail's parameter gradients, a fixed cost (``trace._tail_transient``).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch import nn

from .trace_export import draws_random

aten = torch.ops.aten


#: ops that act on each position alone (dimension arguments are checked in ``_dims_ok``)
POSITIONWISE = {
    aten.linear.default, aten.addmm.default, aten.mm.default, aten.t.default, aten.transpose.int,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.neg.default, aten.rsqrt.default,
    aten.sqrt.default, aten.exp.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.erf.default, aten.mean.dim, aten.sum.dim_IntList,
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.layer_norm.default, aten.native_layer_norm.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.slice.Tensor, aten.cat.default,
    aten.dropout.default, operator.getitem,     # a dropout that draws leaves the block untiled (find_tail)
}
_SHAPED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_DIM_ARG = {aten.transpose.int: (1, 2), aten.mean.dim: (1,), aten.sum.dim_IntList: (1,), aten.unsqueeze.default: (1,),
            aten.squeeze.dim: (1,), aten.split.Tensor: (2,), aten.split_with_sizes.default: (2,),
            aten.chunk.default: (2,), aten.slice.Tensor: (1,), aten.cat.default: (1,)}
_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default}


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _kind(t, mb: int, seq: int) -> str | None:
    """'act' ([mb, seq, ...]), 'flat' ([mb * seq, ...]) or 'fixed' (no position dimension) for a tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    if t.dim() >= 2 and t.shape[0] == mb and t.shape[1] == seq:
        return "act"
    if t.dim() >= 1 and t.shape[0] == mb * seq:
        return "flat"
    return "fixed" if seq not in t.shape and mb * seq not in t.shape else None


def _outputs(n):
    v = _val(n)
    return list(v) if isinstance(v, (tuple, list)) else [v]


def _dims_ok(n: fx.Node, kind: str | None) -> bool:
    """Does the node leave the batch and position dimensions alone?"""
    if kind == "fixed":
        return True
    if n.target is aten.t.default:       # transposes a 2-d tensor: only position-free ones (weights)
        return False
    if n.target not in _DIM_ARG:
        return True
    src = n.args[0][0] if n.target is aten.cat.default else n.args[0]
    ndim = _val(src).dim() if isinstance(_val(src), torch.Tensor) else 0
    if n.target is aten.unsqueeze.default:
        ndim += 1
    fixed = {0, 1} if kind == "act" else {0}
    for i in _DIM_ARG[n.target]:
        arg = n.args[i] if len(n.args) > i else n.kwargs.get("dim", 0)
        for d in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if not isinstance(d, int) or (d % ndim if ndim else d) in fixed:
                return False
    return True


def _shape_ok(n: fx.Node, mb: int, seq: int) -> bool:
    """A shape argument chunking can rewrite: the position dimension where it stands, nowhere else."""
    if n.target not in _SHAPED:
        return True
    shape = list(n.args[1])
    kind = _kind(_val(n), mb, seq)
    rest = shape[2:] if kind == "act" else shape[1:] if kind == "flat" else shape
    return seq not in rest and mb * seq not in rest and (kind != "flat" or shape[0] in (mb * seq, -1))


def _eligible(n: fx.Node, mb: int, seq: int, params: set) -> bool:
    if n.op != "call_function" or n.target not in POSITIONWISE:
        return False
    kinds = {_kind(t, mb, seq) for t in _outputs(n) if isinstance(t, torch.Tensor)}
    if None in kinds or not kinds:
        return False
    for a in n.all_input_nodes:
        if a.name in params:
            continue
        ins = {_kind(t, mb, seq) for t in _outputs(a) if isinstance(t, torch.Tensor)}
        if None in ins:
            return False
    kind = "act" if "act" in kinds else "flat" if "flat" in kinds else "fixed"
    return _dims_ok(n, kind) and _shape_ok(n, mb, seq)


def find_tail(gm: fx.GraphModule, mb: int, seq: int) -> list[fx.Node]:
    """The block's position-wise tail (module docstring), or [] if there is none worth tiling."""
    params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    tail: list[fx.Node] = []
    for n in reversed(nodes):
        if not _eligible(n, mb, seq, params):
            break
        tail.append(n)
    tail.reverse()
    inside = set(tail)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaving = [n for n in tail if any(u not in inside for u in n.users)]
    if not any(n.target in _MATMULS for n in tail):
        return []
    if any(u is not out for n in leaving for u in n.users if u not in inside):
        return []
    if any(_kind(_val(n), mb, seq) != "act" for n in leaving):
        return []
    region, ext, _ = _region(gm, tail, mb, seq, seq)
    for a in ext:   # constants would have to move with the tail's code; activations must be unambiguous
        t = _val(a)
        if a.op == "get_attr" or not isinstance(t, torch.Tensor):
            return []
        if _kind(t, mb, seq) == "act" and list(t.shape).count(seq) != 1:
            return []
        if _kind(t, mb, seq) == "flat":     # a chunk's rows of [batch * seq, ...] are not one slice
            return []
    return [] if draws_random(region) else tail


def _region(gm: fx.GraphModule, tail: list[fx.Node], mb: int, seq: int, chunk: int):
    """(GraphModule of the tail at ``chunk`` positions, its external inputs, its outputs), the inputs
    in a fixed order: activations first, then parameters and other position-free values."""
    inside = set(tail)
    ext: list[fx.Node] = []
    for n in tail:
        for a in n.all_input_nodes:
            if a not in inside and a not in ext:
                ext.append(a)
    ext.sort(key=lambda a: _kind(_val(a), mb, seq) != "act")
    leaving = [n for n in tail if any(u not in inside for u in n.users)]
    g = fx.Graph()
    env = {a: g.placeholder(f"x{i}") for i, a in enumerate(ext)}
    for n in tail:
        new = g.node_copy(n, lambda a: env[a])
        if n.target in _SHAPED and chunk != seq:
            shape = list(n.args[1])
            kind = _kind(_val(n), mb, seq)
            if kind == "act" and shape[1] == seq:
                shape[1] = chunk
            elif kind == "flat" and shape[0] == mb * seq:
                shape[0] = mb * chunk
            new.args = (new.args[0], shape, *new.args[2:])
        env[n] = new
    g.output(tuple(env[n] for n in leaving))
    return fx.GraphModule(nn.Module(), g), ext, leaving


class TiledTail(nn.Module):
    """The tail's code at each chunk length it runs at (the last chunk may be shorter)."""

    def __init__(self, gm: fx.GraphModule, tail: list[fx.Node], mb: int, seq: int, tokens: int):
        super().__init__()
        self.mb, self.seq, self.tokens = mb, seq, tokens
        self.n_chunks = math.ceil(seq / tokens)
        # the block's untiled graph and the tail's nodes in it: to rewrite the code for other chunk lengths
        # (plain attributes, not submodules: the block's constants must not be registered twice)
        object.__setattr__(self, "_gm", gm)
        object.__setattr__(self, "_tail", tail)
        self._by_len: dict[int, fx.GraphModule] = {}
        full, ext, _ = _region(gm, tail, mb, seq, seq)
        self.n_act = sum(_kind(_val(a), mb, seq) == "act" for a in ext)
        self.ext_vals = [_val(a) for a in ext]      # meta values of its inputs (trace measures one chunk)
        self.full_graph = full      # the code of one chunk, as trace._op_count counts it

    def code(self, length: int):
        """The tail's function at ``length`` positions.  Its ``forward``, not the module's call: module hooks
        (``FlopCounterMode``'s tracker) would register gradient hooks on inputs inside a no-grad forward."""
        if length not in self._by_len:
            self._by_len[length] = _region(self._gm, self._tail, self.mb, self.seq, length)[0]
        return self._by_len[length].forward

    def chunks(self):
        return [(s, min(self.tokens, self.seq - s)) for s in range(0, self.seq, self.tokens)]


class _ChunkedTail(torch.autograd.Function):
    """The tail over chunks of positions: forward without keeping intermediates, backward chunk by chunk."""

    @staticmethod
    def forward(ctx, tail: TiledTail, *inputs):
        ctx.tail = tail
        ctx.save_for_backward(*inputs)
        acts, rest = inputs[:tail.n_act], inputs[tail.n_act:]
        outs = None
        for s, n in tail.chunks():      # each chunk's result straight into the output: no second copy
            part = tail.code(n)(*(a[:, s:s + n] for a in acts), *rest)
            if outs is None:
                outs = [p.new_empty((p.shape[0], tail.seq, *p.shape[2:])) for p in part]
            for o, p in zip(outs, part):
                o[:, s:s + n] = p
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        tail: TiledTail = ctx.tail
        inputs = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        out = [None] * len(inputs)
        for k, (t, nd) in enumerate(zip(inputs, need)):
            if nd:   # activations' gradients are written chunk by chunk; parameters' summed in fp32
                out[k] = torch.empty_like(t) if k < tail.n_act else torch.zeros_like(t, dtype=torch.float32)
        for s, n in tail.chunks():
            with torch.enable_grad():
                xs = [t[:, s:s + n] if k < tail.n_act else t for k, t in enumerate(inputs)]
                xs = [x.detach().requires_grad_(nd) for x, nd in zip(xs, need)]
                ys = tail.code(n)(*xs)
                pairs = [(y, g[:, s:s + n]) for y, g in zip(ys, grads) if g is not None and y.requires_grad]
                wrt = [x for x, nd in zip(xs, need) if nd]
                got = iter(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                           if pairs and wrt else [None] * len(wrt))
            for k, nd in enumerate(need):
                if not nd:
                    continue
                g = next(got)
                if g is None:
                    g = torch.zeros_like(xs[k])
                if k < tail.n_act:
                    out[k][:, s:s + n] = g
                else:
                    out[k] += g
        grads_in = [g.to(t.dtype) if g is not None and k >= tail.n_act else g
                    for k, (g, t) in enumerate(zip(out, inputs))]
        return (None, *grads_in)


def run_tail(tail: TiledTail, *inputs):
    """What a tiled block's graph calls in place of its tail."""
    return _ChunkedTail.apply(tail, *inputs)


def tile_block(gm: fx.GraphModule, mb: int, seq: int, tokens: int) -> fx.GraphModule | None:
    """``gm`` with its tail replaced by a call to ``run_tail`` over chunks of ``tokens``; None if the block has
    no tail worth tiling or is no longer than one chunk."""
    if seq <= tokens:
        return None
    tail = find_tail(gm, mb, seq)
    if not tail:
        return None
    tiled = TiledTail(gm, tail, mb, seq, tokens)
    _, ext, leaving = _region(gm, tail, mb, seq, seq)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(tail)
    holder = nn.Module()
    holder.add_module("tiled_tail", tiled)
    for n in gm.graph.nodes:
        if n in inside or n.op == "output":
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "get_attr":
            obj = getattr(gm, n.target)
            if isinstance(obj, nn.Module):
                holder.add_module(n.target, obj)
            elif isinstance(obj, torch.Tensor):
                holder.register_buffer(n.target, obj)
            else:
                setattr(holder, n.target, obj)
    call = g.call_function(run_tail, (g.get_attr("tiled_tail"), *(env[a] for a in ext)))
    for i, n in enumerate(leaving):
        env[n] = g.call_function(operator.getitem, (call, i))
    old_out = next(n for n in gm.graph.nodes if n.op == "output")
    g.output(fx.node.map_arg(old_out.args[0], lambda a: env[a]))
    return fx.GraphModule(holder, g)


def _annotate(b, sp, params: dict) -> None:
    """Give the block program's placeholders (parameters, then inputs) the meta values the exported graph's
    nodes carry, so the tail's inputs have shapes too."""
    holders = [n for n in b.gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(holders, [*b.param_names, *b.input_names]):
        if "val" not in node.meta:
            shape, dtype = (tuple(params[name].shape), params[name].dtype) if name in params else sp.values[name][:2]
            node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")


def tile_split(sp, tokens: int, micro_batch: int, seq_len: int, params: dict) -> list[str]:
    """Tile every layer block of ``sp`` that has a tail (each distinct program once); returns their names.
    ``params``: the model's parameters by name (their shapes and dtypes)."""
    done: dict[int, fx.GraphModule | None] = {}
    names = []
    for b in sp.blocks:
        if b.kind != "layer":
            continue
        if id(b.gm) not in done:
            _annotate(b, sp, params)
            done[id(b.gm)] = tile_block(b.gm, micro_batch, seq_len, tokens)
        if done[id(b.gm)] is not None:
            b.gm = done[id(b.gm)]
            names.append(b.name)
    return names

