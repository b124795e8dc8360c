"""The cost graph the solvers read: a networkx DiGraph of boundaries, recompute segments and
schedule windows, with every coefficient the MILP needs as node / edge attributes.

Nodes
- ``("boundary", i)`` for i = 0..L: ``bytes`` (per micro-batch) live at boundary i;
- ``("block", j)``: ``params_bytes``, ``grad_accum_bytes`` (fp32 on the GPU), ``saved_bytes`` and
  ``workspace_bytes`` per micro-batch, ``backward_transient_bytes`` (backward's workspace + its
  parameter-gradient temporary), ``grad_drain_bytes`` (the accumulator plus its cast copy, alive
  while ``grad_offload`` drains it under the next block's backward), ``fwd_s`` / ``bwd_s`` per micro-batch, ``load_s``,
  ``grad_offload_s`` and ``update_s`` (the mandatory traffic and host work of the block),
  ``gpu_update_s`` (a resident block's update on the GPU; its parameter and gradient bytes are 0 here:
  they are in the static ``Sizes.resident_bytes``);
- ``("window", w)`` for w = 0..2L: ``kind`` ("F", "B" or "X"), ``block`` it belongs to, and the
  mandatory traffic placed there by the lowering: ``h2d_s`` (the prefetched parameter load),
  ``d2h_s`` (the previous backward block's gradients).
Edges
- ``("boundary", s) -> ("boundary", e)`` for every feasible recompute segment [s, e): ``recompute_s``
  (forward of blocks s..e-1 per micro-batch) and ``bytes`` (what the segment's start must keep);
- ``("block", j) -> ("window", w)``: ``role`` "forward" / "backward" / "update".

Units are seconds and bytes; the MILP rescales to ms and GiB.
"""

from __future__ import annotations

import networkx as nx

from ..ir import TensorId, TensorKind
from .cost import CostModel

MAX_SEGMENT = 8


def window_of(kind: str, j: int, L: int) -> int:
    """Window index: F_j = j, B_j = 2L-1-j, X = 2L."""
    return {"F": j, "B": 2 * L - 1 - j, "X": 2 * L}[kind]


def build_cost_graph(cost: CostModel, max_segment: int = MAX_SEGMENT) -> nx.DiGraph:
    g = cost.graph
    L = g.n_blocks
    G = nx.DiGraph(n_blocks=L, micro_batch=cost.micro_batch)
    for i in range(L + 1):
        G.add_node(("boundary", i), bytes=cost.act_bytes(i) if i < L else 0)
    for j in range(L):
        moving = j not in cost.resident      # a resident block's parameters and gradients are static
        G.add_node(("block", j), params_bytes=cost.moving_param_bytes(j),
                   grad_accum_bytes=cost.sizes.grad_numel(j) * 4 if moving else 0,
                   saved_bytes=cost.saved_bytes(j), workspace_bytes=cost.sizes.workspace(j),
                   backward_transient_bytes=cost.sizes.backward_workspace(j) + cost.sizes.param_grad_transient(j),
                   grad_drain_bytes=(cost.sizes.of(TensorId(kind=TensorKind.GRADS, index=j))
                                     + cost.sizes.grad_cast_transient(j)) if moving else 0,
                   fwd_s=cost.fwd_s(j), bwd_s=cost.bwd_s(j), load_s=cost.load_s(j),
                   grad_offload_s=cost.grad_offload_s(j), update_s=cost.host_update_s(j),
                   gpu_update_s=cost.gpu_update_s(j), kind=g.blocks[j].kind)
    for w in range(2 * L + 1):
        if w < L:
            kind, j = "F", w
            h2d = cost.load_s(j + 1) if j + 1 < L else 0.0
            d2h = 0.0
        elif w < 2 * L:
            kind, j = "B", 2 * L - 1 - w
            h2d = cost.load_s(j - 1) if 0 < j <= L - 1 and j - 1 != L - 1 else 0.0
            d2h = cost.grad_offload_s(j + 1) if j + 1 < L else 0.0
        else:
            kind, j = "X", None
            h2d, d2h = cost.load_s(0), cost.grad_offload_s(0)
        G.add_node(("window", w), kind=kind, block=j, h2d_s=h2d, d2h_s=d2h)
        if j is not None:
            G.add_edge(("block", j), ("window", w), role="forward" if kind == "F" else "backward")
    for s in range(L):
        acc = 0.0
        for e in range(s + 1, min(L, s + max_segment) + 1):
            acc += cost.fwd_s(e - 1)
            G.add_edge(("boundary", s), ("boundary", e), recompute_s=acc, bytes=cost.act_bytes(s))
    return G


def block_attr(G: nx.DiGraph, name: str) -> list:
    """One attribute of every block, in block order."""
    return [G.nodes[("block", j)][name] for j in range(G.graph["n_blocks"])]
