"""Reading ``compile_model``'s ``resident`` argument: which blocks every plan must keep on the GPU,
and whether the MILP may choose a leading prefix itself (``"auto"``; see ``Decisions.resident`` for
what a resident block is and ``solvers/milp.py`` for how the solver prices it)."""

from __future__ import annotations

from ..ir import ModelGraph
from ..ir.semantics import tie_closure


def resident_request(graph: ModelGraph, resident) -> tuple[frozenset, bool]:
    """(fixed resident blocks, may the solver choose more?) from the ``resident`` argument."""
    L = graph.n_blocks
    if resident is None or resident == "none":
        return frozenset(), False
    if resident == "auto":
        return frozenset(), True
    if isinstance(resident, bool):
        raise ValueError("resident must be 'none', 'auto', a number of leading blocks or a list of block indices")
    if isinstance(resident, int):
        if not 0 <= resident <= L:
            raise ValueError(f"resident={resident}: the model has {L} blocks")
        return tie_closure(graph, range(resident)), False
    try:
        blocks = {int(j) for j in resident}
    except (TypeError, ValueError):
        raise ValueError(f"resident must be 'none', 'auto', a number of leading blocks or a list of block indices, "
                         f"got {resident!r}") from None
    bad = sorted(j for j in blocks if not 0 <= j < L)
    if bad:
        raise ValueError(f"resident blocks {bad} out of range 0..{L - 1}")
    return tie_closure(graph, blocks), False
