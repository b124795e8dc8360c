"""The time a compile's planning may take: one record (``TimeLimits``, the defaults in ``LIMITS``) for the search
(``compiler/search.py``, ``compiler/deadline.py``), the GPU-update rule after it (``compiler/gpu_update.py``) and the
loss head's re-solve (``compiler/loss_chunk.py``).  Every figure is CPU seconds (this process's and the solver's,
``deadline.compile_cpu_seconds``; ``isolated.WALL_FACTOR`` times as many wall seconds at most), so a busy machine does
not change the plan.  A "short" chain is one of at most ``short_chain_blocks`` blocks (8B-class models; ``search.
milp_size``: a compiled block counts once per cut).

Why these numbers:

- ``solver_s``, ``short_solver_s``: solver seconds one compile spends in all, shared evenly by the micro-batches it
  tries (no-good re-solves draw on their micro-batch's share; every solve gets at least ``min_solve_s``): a compile
  answers in seconds whatever the solver's luck, and a time limit returns the incumbent.  qwen2.5-3b with compiled
  blocks (38 blocks, 4 cuts a layer: 146) at 24 GiB, batch 8 needs six ~1.3 s solves to a plan in budget (0.466 s
  predicted, megatrain 0.961) and ended on megatrain with the short ones.  The short budget and deadline (2.5 s; 4 s
  before): on 27 presets x budgets x batches of qwen2.5-3b, qwen2.5-7b and llama3-8b the MILP's plans (every block
  streamed, no rule) were the same at 2.5 s as at 4 s, each compile 1-1.5 s shorter where the search had run to its
  deadline; with the resident choice and the rule, 16 of 16 batch-8/32 rows at 24/48 GiB as fast or faster (the
  rule's re-solve then ends elsewhere: llama3-8b 48 GiB b8 1.360 s against 1.424).
- ``deadline_s``, ``short_deadline_s``: the planning of one compile, from its start (the graph traced) to its answer:
  the search (the heuristics, every solve, re-solve and the build that checks its plan in time order) and, where it
  follows, the GPU-update rule.  Past the search's part no solve starts and the best plan so far is returned
  (``SolverStats.out_of_time``); a solve's limit is cut so that it and its plan's build (as long as the slowest build
  so far) end by then.  The solver budget plus the builds of its plans: without a deadline qwen2.5-72b at 48 GiB,
  batch 72 searched for 23.9 s (six solves, seven 45,000-op builds of ~2.5 s), over the 20 s a whole compile may
  take.  Short chains get the short one (llama3-8b at 48 GiB, batch 8 re-solved ten times).
- ``rule_reserve_s``, ``short_rule_reserve_s``: the deadline's share the search leaves the GPU-update rule when the
  rule follows it (``Compiler.rule_follows``; the rule takes at most ``rule_s`` of what is left): long chains carve it
  out of their deadline (the rule's 6 s counted apart, on top of a 15 s search, put 32B-72B compiles at 20-23 s),
  short chains get it on top of their 2.5 s (there the rule's plan is often much faster than the solved one --
  llama3-8b at 24 GiB, batch 8: 1.66 s simulated against 2.20 s; 3 s find it since the rule prunes its scans and a
  build takes ~20 ms at 8B, where 6 s were needed before).  A caller's deadline leaves the rule at most half of it.
- ``rule_s``: the rule's scans and its re-solve together (each plan built costs a lowering, ``verify`` and a
  simulation: 0.05-0.3 s for qwen2.5-3b; the re-solve gets at most half of what the first scan left).  Per scan,
  with the re-solve on the search's own deadline, the rule took up to 19 s of a qwen2.5-14b compile (33 s in all).
- ``rule_resolve_gain``: the rule re-solves only where the blocks it would make room for shorten the scan's best
  step by this share on the solved plan's other decisions: the memory it takes from the rest costs the re-solved
  plan about as much (qwen2.5-7b at 80 GiB, batch 8: 0.47% to gain, the re-solve with 1.05 GiB less memory 0.8%
  slower).
- ``head_resolve_gain``: the loss head's pass re-solves for the single pass where its head alone saves this share
  of the step as priced (qwen2.5-7b at 80 GiB, batch 32, calibrated: the recompute head 584 ms a step; re-solved for
  the single pass, the MILP's plan predicted 2.606 s against 2.951 and measured 2.703 against 3.087).
- ``head_resolve_s``, ``short_head_resolve_s``: that solve at most; it draws on what the compile's deadline has left
  after the search and the rule (the builds of its pass too), and is not tried with less than ``min_solve_s`` left
  or where the search itself ran out of its deadline.  On the compile grid's presets up to 8B (2 cores): of 11
  re-solves 8 won (steps 1.0-3.3% shorter, 0.28-0.92 s each), 3 lost (batch 8 at 80 GiB, 0.84-2.1 s); one that took
  a compile of qwen2.5-7b (24 GiB, batch 32) to 6.2 s followed a search out of its deadline, and lost.  Short chains:
  every win above took under 1 s, and the losing 2 s put llama3-8b at 80 GiB, batch 8 over 5 s a compile; at 1.2 s
  the 54 compiles up to 8B gave the same plans as at 2 s (``benchmarks/results/compile_times_cold.md``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TimeLimits:
    """What bounds a compile's planning time (the module docstring says why each figure)."""

    #: one MILP solve, where the caller gives no ``time_limit`` (a time limit returns the incumbent and its gap)
    solve_s: float = 10.0
    #: all the solves of one compile's search, a long chain's
    solver_s: float = 12.0
    #: all the solves of one compile's search, a short chain's
    short_solver_s: float = 2.5
    #: the most blocks a chain has to count as short
    short_chain_blocks: int = 48
    #: the least a solve is started with
    min_solve_s: float = 0.5
    #: the compile's planning (search and GPU-update rule), a long chain's
    deadline_s: float = 15.0
    #: the compile's planning (search and GPU-update rule), a short chain's
    short_deadline_s: float = 2.5
    #: the share of a long chain's deadline the search leaves the GPU-update rule
    rule_reserve_s: float = 3.0
    #: the time a short chain's deadline adds for the GPU-update rule
    short_rule_reserve_s: float = 3.0
    #: the GPU-update rule, its scans and re-solve together
    rule_s: float = 6.0
    #: the least the GPU-update rule's re-solve is started with
    min_rule_resolve_s: float = 1.0
    #: the share of the step the GPU-update rule's re-solve must stand to gain
    rule_resolve_gain: float = 0.01
    #: the share of the step the loss head's single pass must save for its re-solve
    head_resolve_gain: float = 0.01
    #: the loss head's re-solve, a long chain's
    head_resolve_s: float = 2.0
    #: the loss head's re-solve, a short chain's
    short_head_resolve_s: float = 1.2


#: the limits every compile plans within
LIMITS = TimeLimits()
