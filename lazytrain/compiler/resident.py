"""Resident blocks in ``compile_model``: reading the ``resident`` argument, and the search for how
many leading blocks to keep on the GPU when it is ``"auto"`` (see ``Decisions.resident`` for what a
resident block is and why the first blocks are the ones worth keeping)."""

from __future__ import annotations

import time

from ..ir import ModelGraph, Plan
from ..ir.semantics import tie_closure


def resident_request(graph: ModelGraph, resident) -> tuple[frozenset, bool]:
    """(fixed resident blocks, search?) from ``compile_model``'s ``resident`` argument."""
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


#: the ``resident="auto"`` search runs when the streamed plan's step exceeds its GPU work by more
MIN_RESIDENT_GAIN = 0.05
#: MILP time limit (s) per resident candidate
SCREEN_TIME_LIMIT = 3.0
#: ... and refines its doubling only when that found at least this gain (qwen2.5-32b b72 80 GiB: 0.7%
#: for 60 s of refining solves)
MIN_REFINED_GAIN = 0.02


def best_resident(comp, policy: str, batch_size: int, micro_batch: int | None, base: Plan,
                  refine: int = 3) -> Plan:
    """Search how many leading blocks to keep resident (tied groups whole).  More resident blocks take
    host update work off the step's critical path (the forward waits for each block's update when a
    layer's update outlasts its compute) and cost GPU memory the activations could use, so the
    predicted step time falls, then rises.  Doubling 1, 2, 4, ... until a count is not better,
    then ``refine`` bisections of the bracket around the best count."""
    L = comp.graph.n_blocks
    t = time.perf_counter()
    busy = base.predicted.get("busy_s", {}).get("gpu", 0.0)
    if base.predicted["step_time_s"] <= (1 + MIN_RESIDENT_GAIN) * busy:
        # resident blocks only move work off the host and PCIe and take memory from the activations:
        # they cannot make the step shorter than its GPU work.  When that bound leaves less than
        # MIN_RESIDENT_GAIN to gain, the search's solves are not worth their time (qwen2.5-72b, batch
        # 72, 80 GiB: 2.8% bound, 0.5% found, for 11 s of a 12 s compile); ask for resident=N then
        base.decisions.notes["resident_search"] = (
            f"skipped: the streamed plan's step is within {MIN_RESIDENT_GAIN:.0%} of its GPU work")
        return base
    plans: dict[frozenset, Plan | None] = {frozenset(): base}

    def step_of(k: int) -> float:
        cand = tie_closure(comp.graph, range(k)) if k else frozenset()
        if cand not in plans:
            # candidates are screened with a shorter solver limit: the search compares plans, and a
            # 64-layer solve that hits the 10 s limit costs that for each (qwen2.5-32b b72: 76 s in all)
            c = comp.for_resident(cand, time_limit=min(comp.time_limit or SCREEN_TIME_LIMIT, SCREEN_TIME_LIMIT))
            # at the streamed plan's micro-batch: the memory resident blocks take is traded against
            # activations by the solver there (a search over micro-batches per candidate costs ~3x)
            plans[cand] = c.best(policy, batch_size, micro_batch or base.micro_batch)
        p = plans[cand]
        return float("inf") if p is None else p.predicted["step_time_s"]

    best_k, lo, k = 0, 0, 1
    while k <= L and step_of(k) < step_of(best_k):
        lo, best_k, k = best_k, k, k * 2
    hi = min(k, L + 1)              # first count found worse (or past the end)
    if step_of(best_k) > (1 - MIN_REFINED_GAIN) * step_of(0):
        refine = 0                  # a flat curve: bisecting it costs solves for fractions of a percent
    for _ in range(refine):
        moved = False
        for c in ((best_k + hi) // 2, (lo + best_k) // 2):
            if c in (lo, best_k, hi) or c > L:
                continue
            if step_of(c) < step_of(best_k):
                lo, hi = (best_k, hi) if c > best_k else (lo, best_k)
                best_k, moved = c, True
                break
            lo, hi = (lo, c) if c > best_k else (c, hi)
        if not moved and hi - lo <= 2:
            break
    best = min((p for p in plans.values() if p is not None), key=lambda p: p.predicted["step_time_s"])
    best.history.append({"pass": f"resident search ({len(plans) - 1} candidates, "
                                 f"{len(best.decisions.resident_blocks)} blocks kept)",
                         "seconds": round(time.perf_counter() - t, 4)})
    return best
