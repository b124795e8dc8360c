"""The time a compile's planning may take: one record (``TimeLimits``, the defaults in ``LIMITS``) for the search
(``compiler/search.py``, ``compiler/deadline.py``), the GPU-update rule after it (``compiler/gpu_update.py``) and the
loss head's re-solve (``compiler/loss_chunk.py``).  Every figure is CPU seconds (this process's and the solver's,
``deadline.compile_cpu_seconds``; ``isolated.WALL_FACTOR`` times as many wall seconds at most), so a busy machine does
not change the plan.  A "short" chain is one of at most ``short_chain_blocks`` blocks (8B-class models; ``search.
milp_size``: a compiled block counts once per cut).  Each field says what it bounds; the measurements behind its
value are in ``benchmarks/results/tuning_ledger.md`` under its key.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TimeLimits:
    """What bounds a compile's planning time, field by field (CPU seconds, or a share of the step)."""

    #: one MILP solve without a caller's ``time_limit`` (the incumbent returned): 10 [ledger: api-solve-time-limit]
    solve_s: float = 10.0
    #: all the solves of a long chain's search, shared evenly by its micro-batches: 12 [ledger: search-solver-budget]
    solver_s: float = 12.0
    #: all the solves of a short chain's search: 2.5 [ledger: search-solver-budget]
    short_solver_s: float = 2.5
    #: the most MILP blocks a chain has to count as short: 48 [ledger: search-solver-budget]
    short_chain_blocks: int = 48
    #: the least a solve is started with: 0.5 [ledger: search-solver-budget]
    min_solve_s: float = 0.5
    #: a long chain's planning, search and GPU-update rule, from the traced graph: 15 [ledger: search-deadline]
    deadline_s: float = 15.0
    #: a short chain's planning, search and GPU-update rule: 2.5 [ledger: search-deadline]
    short_deadline_s: float = 2.5
    #: what a long chain's search leaves of its deadline to the GPU-update rule: 3 [ledger: search-rule-reserve]
    rule_reserve_s: float = 3.0
    #: what a short chain's deadline adds for the GPU-update rule: 3 [ledger: search-rule-reserve]
    short_rule_reserve_s: float = 3.0
    #: the GPU-update rule, its scans and re-solve together: 6 [ledger: gpu-update-rule-budget]
    rule_s: float = 6.0
    #: the least the GPU-update rule's re-solve is started with: 1 [ledger: gpu-update-resolve]
    min_rule_resolve_s: float = 1.0
    #: the share of the step the rule's re-solve must stand to gain: 1% [ledger: gpu-update-resolve]
    rule_resolve_gain: float = 0.01
    #: the share of the step the single-pass head must save for its re-solve: 1% [ledger: loss-head-resolve]
    head_resolve_gain: float = 0.01
    #: the loss head's re-solve, a long chain's: 2 [ledger: loss-head-resolve]
    head_resolve_s: float = 2.0
    #: the loss head's re-solve, a short chain's: 1.2 [ledger: loss-head-resolve]
    short_head_resolve_s: float = 1.2


#: the limits every compile plans within
LIMITS = TimeLimits()
