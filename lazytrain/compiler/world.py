"""What a compile for several ranks checks and changes: the world's shape, and the budgets per rank.

A plan for ``world_size`` ranks over ``nodes`` hosts is one rank's op list (every rank runs the same
one, ``ir.sharding``).  GPU memory is per GPU already; the host (and NVMe) budget is per host, shared
by the ``world_size / nodes`` ranks on it, so each rank's is its share.
"""

from __future__ import annotations

import dataclasses

from ..ir.schema import MAX_WORLD
from .budgets import Budgets


def check_world(world_size: int, nodes: int) -> None:
    """Refuse a world of the wrong shape (one line each, naming the fix).  Tied parameters and resident
    blocks shard like the rest (``ir.sharding``, ``ir.semantics.resident_shards``)."""
    for name, v in (("world_size", world_size), ("nodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_WORLD:
            raise ValueError(f"{name} must be a whole number in 1..{MAX_WORLD}, got {v!r}")
    if world_size % nodes:
        raise ValueError(f"world size {world_size} is not a multiple of the {nodes} nodes: every host runs "
                         "the same number of ranks")


def per_rank_budgets(budgets: Budgets, world_size: int, nodes: int) -> Budgets:
    """The budgets of one rank: its host's memory shared by the ranks on that host."""
    per_host = world_size // nodes
    # a host's NVMe folder is shared the same way
    shares = {key: getattr(budgets, key) // per_host for key in ("host_bytes", "nvme_bytes") if getattr(budgets, key)}
    return dataclasses.replace(budgets, **shares)
