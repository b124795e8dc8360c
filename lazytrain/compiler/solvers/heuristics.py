"""Fixed-rule policies: baselines to compare against and warm starts for the MILP.

- ``megatrain``: keep a boundary every 4 layers on the GPU and recompute the rest in segments
  (the matched baseline: what MegaTrain does), no activation offload;
- ``recompute-all``: keep every block's input boundary on the GPU, recompute every block;
- ``keep-all``: keep everything backward needs on the GPU (no recomputation).
"""

from __future__ import annotations

from ...ir import Decisions, ModelGraph, Place, Saved
from ..options import Policy

SEGMENT = 4


def megatrain(graph: ModelGraph, micro_batch: int, n_micro: int, every: int = SEGMENT) -> Decisions:
    L = graph.n_blocks
    layers = [b.index for b in graph.blocks if b.kind == "layer"]
    first = layers[0] if layers else 0
    boundary = []
    for i in range(L):
        in_layers = i in layers
        keep = i == 0 or not in_layers or (i - first) % every == 0
        boundary.append(Place.GPU if keep else Place.NONE)
    boundary[0] = Place.HOST
    return Decisions(policy="megatrain", micro_batch=micro_batch, n_micro=n_micro, boundary=tuple(boundary),
                     saved=tuple(Saved.RECOMPUTE for _ in range(L)))


def recompute_all(graph: ModelGraph, micro_batch: int, n_micro: int) -> Decisions:
    L = graph.n_blocks
    return Decisions(policy="recompute-all", micro_batch=micro_batch, n_micro=n_micro,
                     boundary=(Place.HOST,) + (Place.GPU,) * (L - 1), saved=(Saved.RECOMPUTE,) * L)


def keep_all(graph: ModelGraph, micro_batch: int, n_micro: int) -> Decisions:
    L = graph.n_blocks
    return Decisions(policy="keep-all", micro_batch=micro_batch, n_micro=n_micro,
                     boundary=(Place.NONE,) * L, saved=(Saved.KEEP,) * L)


HEURISTICS = {Policy.MEGATRAIN: megatrain, Policy.RECOMPUTE_ALL: recompute_all, Policy.KEEP_ALL: keep_all}
