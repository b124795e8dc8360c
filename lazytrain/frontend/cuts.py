"""Cuts of a compiled block: which values its forward saves for the backward, and which the backward recomputes.

A compiled block (``compiled.py``) is AOTAutograd's joint forward + backward graph, partitioned.  The cut
``torch.compile`` trains with (min-cut, activation memory budget 1.0) saves every matmul and attention output
and recomputes only pointwise and normalisation ops: fast, but for a decoder layer ~20x the bytes of its input
boundary.  Between that and recomputing the whole
forward from the boundary lie cuts that save part of the internals and recompute the rest inside the backward
(Checkmate's choice, per block).  The compiler is offered a few of them per block program and chooses one per
block (``Decisions.cut``): the MILP weighs each cut's saved bytes (kept, offloaded or reloaded) against the
backward's extra time.

Where the cuts come from: the partitioner's own activation memory budget
(``torch._functorch.config.activation_memory_budget``): at budget b it solves a 0-1 knapsack for the least
recompute that saves at most b of the way from "inputs only" (0.0) to min-cut (1.0), and cuts the joint graph
there.  So every cut is derived from the block's graph (shapes, FLOPs), for any architecture the tracer
handles; nothing is written per model.  ``CUT_BUDGETS`` are the budgets offered; cuts that save no fewer bytes
than a larger budget's are dropped, so a block may have fewer (an embedding has one: it saves its ids).

The knapsack prices a recomputed op by ``flop_estimate()``: its FLOPs, attention counted as the fused kernel does
(``attention.forward_flops``, causal as half), the same on every device, so the trace's partition on ``meta``
and the runtime's on the GPU choose from the same prices.  What the trace records per cut (``ir.Cut``): its
saved bytes and the FLOPs its backward runs beyond the min-cut backward (matmuls and attention apart, as the
cost model prices them).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .attention import AttentionCount, forward_flops

#: activation memory budgets offered per compiled block, min-cut (1.0) first; the MILP picks one [ledger: cut-budgets]
CUT_BUDGETS = (1.0, 0.7, 0.35, 0.0)


def _is_attention_forward(target) -> bool:
    name = getattr(target, "__name__", "")
    return "scaled_dot_product" in name and "attention" in name and "backward" not in name


def _argument(node: fx.Node, name: str, default=None):
    """An aten call's argument by its schema name, wherever the call passed it."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else default
    return default


def _meta(v) -> torch.Tensor | object:
    if isinstance(v, fx.Node):
        v = v.meta.get("val")
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(int(s) for s in v.shape), tuple(int(s) for s in v.stride()),
                                   dtype=v.dtype, device="meta")
    return v


def op_flops(node: fx.Node) -> float:
    """The partitioner's price of recomputing one op: its FLOPs (at least 1, so nothing is free), fused attention
    counted as ``attention.forward_flops`` (any of the SDPA kernels: the flash, efficient, cuDNN and CPU ones
    name ``is_causal`` differently in position, never in name)."""
    if _is_attention_forward(node.target):
        q, k, v = (_meta(a) for a in node.args[:3])
        causal = bool(_argument(node, "is_causal", False)) and _argument(node, "attn_mask") is None \
            and _argument(node, "attn_bias") is None
        return float(max(forward_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape), causal), 1))
    try:
        args = [_meta(a) for a in node.args]
        kwargs = {k: _meta(a) for k, a in node.kwargs.items()}
        with FlopCounterMode(display=False) as fc:
            node.target(*args, **kwargs)
        return float(max(fc.get_total_flops(), 1))
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run costs what a pointwise op does
        return 1.0


@functools.cache
def flop_estimate():
    """``op_flops`` as the partitioner's runtime estimator: a ``CustomRuntimeEstimator`` with a ``uuid`` (what
    AOTAutograd's cache keys on).  Its class is made on first use: importing ``torch._inductor`` pulls in
    dynamo (~0.5 s of CPU), which a compile that reads its trace from the cache never needs."""
    from torch._inductor.custom_graph_pass import CustomRuntimeEstimator

    class FlopEstimate(CustomRuntimeEstimator):
        def __call__(self, node: fx.Node) -> float:
            return op_flops(node)

        def uuid(self) -> str:
            return "lazytrain.frontend.cuts.FlopEstimate/1"

    return FlopEstimate()


@contextlib.contextmanager
def budget(value: float):
    """The partitioner cuts at activation memory budget ``value`` inside this block (1.0: min-cut, untouched)."""
    if value >= 1.0:
        yield
        return
    import torch._functorch.config as functorch_config
    with functorch_config.patch(activation_memory_budget=float(value),
                                activation_memory_budget_runtime_estimator=flop_estimate(),
                                activation_memory_budget_solver="dp"):
        yield


def graph_flops(gm: fx.GraphModule) -> tuple[int, int]:
    """(FLOPs, of them fused attention forward) of running ``gm`` once, on meta tensors at its placeholders'
    shapes; attention as the fused kernel does it (``AttentionCount``)."""
    attn = AttentionCount()
    args = [_meta(n) for n in gm.graph.nodes if n.op == "placeholder"]
    with FlopCounterMode(display=False, custom_mapping=attn.mapping()) as fc:
        gm(*args)
    return fc.get_total_flops(), attn.fwd_flops
