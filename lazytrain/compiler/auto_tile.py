"""``compile_model(seq_tile="auto")``: the layers' tails tiled (``frontend/tiling.py``) only where that
makes a plan possible."""

from __future__ import annotations

import dataclasses

from ..ir import Plan
from ..ir.graph import TILE_TOKENS, ModelGraph
from .budgets import BudgetError
from .fixed import compile_fixed
from .request import CompileRequest


def compile_auto_tiled(model, req: CompileRequest) -> Plan:
    """``seq_tile="auto"``: the plan of ``req`` without tiling; if no plan fits, and the sequence is longer than one
    chunk, again with the layers' tails in chunks of ``TILE_TOKENS`` (the plan's notes say why).  Tiling costs each
    tail's forward once more in backward, so it is used only where it makes a plan possible."""
    untiled = dataclasses.replace(req, seq_tile=None)
    seq = req.seq_len
    if isinstance(model, ModelGraph) or not isinstance(seq, int) or seq <= TILE_TOKENS:
        return compile_fixed(model, untiled)
    try:
        return compile_fixed(model, untiled)
    except BudgetError as e:
        without = e
    plan = compile_fixed(model, dataclasses.replace(req, seq_tile=TILE_TOKENS))
    if not plan.graph.meta.get("seq_tile"):
        raise without
    plan.decisions.notes["seq_tile"] = f"tails tiled because without tiling no plan fits: {without}"
    return plan


def compile_tiled(model, req: CompileRequest) -> Plan:
    """The plan of a request of one length: the tiling searched where it asks for ``"auto"``, else ``compile_fixed``."""
    return compile_auto_tiled(model, req) if req.seq_tile == "auto" else compile_fixed(model, req)
