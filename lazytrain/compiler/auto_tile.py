"""``compile_model(seq_tile="auto")``: the layers' tails tiled (``frontend/tiling.py``) only where that
makes a plan possible."""

from __future__ import annotations

from ..ir.graph import TILE_TOKENS, ModelGraph
from .budgets import BudgetError


def compile_auto_tiled(compile_fn, model, options: dict):
    """``seq_tile="auto"``: ``compile_fn`` without tiling; if no plan fits, and the sequence is longer than one
    chunk, again with the layers' tails in chunks of ``TILE_TOKENS`` (the plan's notes say why).  Tiling
    costs each tail's forward once more in backward, so it is used only where it makes a plan possible."""
    untiled = {**options, "seq_tile": None}
    seq = options["seq_len"]
    if isinstance(model, ModelGraph) or not isinstance(seq, int) or seq <= TILE_TOKENS:
        return compile_fn(model, **untiled)
    try:
        return compile_fn(model, **untiled)
    except BudgetError as e:
        without = e
    plan = compile_fn(model, **{**options, "seq_tile": TILE_TOKENS})
    if not plan.graph.meta.get("seq_tile"):
        raise without
    plan.decisions.notes["seq_tile"] = f"tails tiled because without tiling no plan fits: {without}"
    return plan
