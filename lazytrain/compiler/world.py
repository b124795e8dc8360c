"""What a compile for several ranks checks and changes: the world's shape, and the budgets per rank.

A plan for ``world_size`` ranks over ``nodes`` hosts is one rank's op list (every rank runs the same
one, ``ir.sharding``).  GPU memory is per GPU already; the host (and NVMe) budget is per host, shared
by the ``world_size / nodes`` ranks on it, so each rank's is its share.
"""

from __future__ import annotations

from ..ir import ModelGraph, PlanError
from ..ir.schema import MAX_WORLD


def check_world(graph: ModelGraph, world_size: int, nodes: int, resident: frozenset) -> None:
    """Refuse a world this compiler cannot shard (one line each, naming the fix)."""
    for name, v in (("world_size", world_size), ("nodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_WORLD:
            raise ValueError(f"{name} must be a whole number in 1..{MAX_WORLD}, got {v!r}")
    if world_size % nodes:
        raise ValueError(f"world size {world_size} is not a multiple of the {nodes} nodes: every host runs "
                         "the same number of ranks")
    if world_size == 1:
        return
    if resident:
        raise ValueError(f"resident blocks are not sharded across ranks: with world size {world_size} use "
                         "resident='none' (or 'auto', which then keeps every block streamed)")
    tied = [b.index for b in graph.blocks if any(p.owner != b.index for p in b.params)]
    if tied:
        raise PlanError(f"{graph.name} ties parameters across blocks (blocks {tied} read another block's): "
                        f"sharding tied parameters over {world_size} ranks is not supported; untie them "
                        "(tie_word_embeddings=False, or tie_weights false for the built-in GPT, in the model's "
                        "config) or train on one GPU")


def per_rank_budgets(budgets: dict, world_size: int, nodes: int) -> dict:
    """The budgets of one rank: its host's memory shared by the ranks on that host."""
    out = dict(budgets)
    per_host = world_size // nodes
    for key in ("host_bytes", "nvme_bytes"):     # a host's NVMe folder is shared the same way
        if out.get(key):
            out[key] = out[key] // per_host
    return out
