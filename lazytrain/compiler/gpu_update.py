"""Which streamed blocks to update on the GPU (``Decisions.gpu_update``): a rule on top of the solved plan.

With exact clipping every host update waits for the global norm at the end of the backward; the host then
updates the streamed blocks in forward order while the GPU runs the resident prefix and the streamed
forwards, and a streamed forward that is shorter than a host update waits for it.  A GPU-updated block takes
itself out of the host's queue (its state crosses PCIe instead: ``state_load`` / ``state_store``), so the
first streamed blocks in forward order, the ones whose updates pace the forward, are the candidates.  It
costs GPU memory (its kept accumulator, 4 bytes a parameter from its backward to the next step's update, and
a few blocks' state in flight), which the solved plan usually has not left free; a resident block holds more
(parameters, state and accumulator for the whole run, ~10 bytes a parameter with the 8-bit optimizer), so
the rule also trades the last blocks of the resident prefix for GPU-updated ones.

The rule (``choose``): for d = 0, 1, ... resident blocks given back (the prefix's last, tie groups never), and k
GPU-updated blocks (the first streamed ones), build the plan (lower, ``verify`` against the budgets, simulate) and
keep the fastest. For each d, k = 1, 2, 3 are built in turn, and on until three more blocks bring nothing or one
does not fit; a step that still falls at k = 3 (each block takes a host update off it until memory, the state copies
or the GPU stop it) is followed by galloping and bisection to the largest k that fits and a search of the best k
below it that assumes the step falls, then rises (``_best_count``), so a long fall costs ~2 log2 k builds, not k. d
grows until two more resident blocks given back bring nothing (before the first gain, a d that fits more blocks than
the last counts as progress: llama3-8b at 48 GiB, batch 8 gains first at d = 3 -- while memory is what stopped the
count: where the step turned first, more room buys nothing). A d after one whose step fell past ``LINEAR`` counts
starts at the last d's largest count instead of k = 1. The solved plan (d = k = 0) is the baseline, so the result is
never slower on the simulator. Where the blocks that would shorten the step most do not fit beside the solved plan's
activations, the search is run once more with the GPU budget lowered by the memory they lack (the solver then keeps
fewer activations or resident blocks), and the scan repeated on that plan with the whole budget (plans built once:
the two scans share them); the faster of the two is kept.  The re-solve runs only where those blocks would shorten
the best step by ``LIMITS.rule_resolve_gain`` on the solved plan's other decisions and need at most
``MAX_ROOM_SHARE`` of the budget. The rule stops after ``LIMITS.rule_s`` CPU seconds, its re-solve included, or
earlier at the compile's deadline (the search leaves it ``LIMITS.rule_reserve_s`` of it; ``compiler/time_limits.py``).
The MILP itself does not price the GPU update (its windows would need the kept accumulators and the state traffic
as terms): the activation and cut decisions stay the solver's. ``plan.decisions.notes["gpu_update"]`` records what
was tried; ``lazytrain show`` says it."""

from __future__ import annotations

import dataclasses
import time
import warnings

from ..ir import Decisions, Plan, PlanError
from ..ir.semantics import tie_closure
from .deadline import compile_cpu_seconds
from .progress import caller_stacklevel, log
from .time_limits import LIMITS

#: GPU-updated blocks (3) and resident blocks given back (2) without a gain that end the scans over k and d
#: [ledger: gpu-update-scan]
K_PATIENCE, D_PATIENCE = 3, 2
#: counts built one by one before galloping and bisection (``_best_count``): 3 [ledger: gpu-update-scan]
LINEAR = 3
#: counts below the largest that fits tried one by one before a ternary search (``_lowest``): 3
#: [ledger: gpu-update-scan]
WALK = 3
#: a step shorter by less than this is no gain: 1 us, the simulator's rounding across periods [ledger: gpu-update-scan]
MIN_GAIN_S = 1e-6
#: the rule re-solves only where the blocks need at most this share of the GPU budget: 1/3
#: [ledger: gpu-update-resolve]
MAX_ROOM_SHARE = 1 / 3
#: a plan whose GPU idles less than this share of its simulated step is left as it is (``choose``): 1%
#: [ledger: gpu-update-scan]
MIN_IDLE_SHARE = 0.01
#: searches run again, each with less GPU budget, to fit the GPU-updated blocks a caller asks for (``fixed``): 3
#: [ledger: gpu-update-resolve]
RESOLVES = 3
#: a plan with the blocks a caller asked for, predicted slower than the solved plan by more than this share, is
#: returned with a warning (``fixed``): 10% [ledger: gpu-update-forced]
FORCED_SLOWER = 0.10


def candidates(plan_graph, dec: Decisions) -> list[int]:
    """Streamed blocks that may be GPU-updated, in forward order: they own trainable parameters, share no tied one,
    are not resident, and are not the head (whose parameters stay loaded into its backward)."""
    L = plan_graph.n_blocks
    return [j for j in range(L - 1) if not dec.is_resident(j) and plan_graph.blocks[j].trainable_numel
            and tie_closure(plan_graph, {j}) == {j}]


def _tradeable(plan_graph, dec: Decisions) -> list[int]:
    """Resident blocks the rule may give back, last first: those sharing no tied parameter."""
    return sorted((j for j in dec.resident_blocks if tie_closure(plan_graph, {j}) == {j}), reverse=True)


def rule_runs(req, policy: str, has_gpu: bool, world_size: int) -> bool:
    """Does ``choose`` run after the search: asked for (``"auto"``), on the MILP's plan, on a GPU, in a world
    of one (the sharded runtime has no GPU-updated blocks)?"""
    return req == "auto" and policy == "milp" and has_gpu and world_size == 1


def request(gpu_update) -> str | int | tuple[int, ...]:
    """``compile_model``'s ``gpu_update`` argument checked: "auto", "none", a number of blocks, or a list."""
    if gpu_update in ("auto", "none", None):
        return gpu_update or "none"
    if isinstance(gpu_update, bool):
        raise ValueError("gpu_update must be 'auto', 'none', a number of streamed blocks or a list of block indices")
    if isinstance(gpu_update, int):
        if gpu_update < 0:
            raise ValueError(f"gpu_update={gpu_update}: a number of blocks is at least 0")
        return gpu_update
    try:
        return tuple(sorted({int(j) for j in gpu_update}))
    except (TypeError, ValueError):
        raise ValueError(f"gpu_update must be 'auto', 'none', a number of streamed blocks or a list of block "
                         f"indices, got {gpu_update!r}") from None


def with_blocks(dec: Decisions, blocks, n_blocks: int) -> Decisions:
    return dataclasses.replace(dec, gpu_update=tuple(j in blocks for j in range(n_blocks)) if blocks else ())


def fixed(search, plan: Plan, req, policy: str, micro_batch: int | None = None) -> Plan:
    """The plan with the GPU-updated blocks asked for (a count: the first streamed ones), checked as any
    (``search``: the ``search.Search`` that found ``plan``; its compiler builds the plans).

    The solved plan usually fills the GPU budget with kept activations, so asked-for blocks often do not fit
    beside it; as ``choose`` does, the search is then run again with the GPU budget lowered by the memory they
    lack (up to ``RESOLVES`` times: the re-solved plan peaks elsewhere) and the blocks put on that plan, checked
    against the whole budget (at the caller's micro-batch, if one was given).  A request that fits no re-solved
    plan raises a ``PlanError`` that says by how much it missed."""
    g, comp = plan.graph, search.comp
    bad = [j for j in (() if isinstance(req, int) else req) if not 0 <= j < g.n_blocks]
    if bad:
        raise ValueError(f"gpu_update blocks {bad} out of range 0..{g.n_blocks - 1}")
    base, gpu_bytes = plan, comp.budgets.gpu_bytes
    for attempt in range(RESOLVES + 1):
        blocks = candidates(g, base.decisions)[:req] if isinstance(req, int) else req
        if not blocks:
            return base
        dec = with_blocks(base.decisions, blocks, g.n_blocks)
        trial = comp.build(dec, base.batch_size, check_budget=False)     # built once: its peak says what it lacks
        if comp.within_budgets(trial):
            _warn_if_slower(trial, plan, blocks, resolved_bytes=comp.budgets.gpu_bytes - gpu_bytes)
            return trial
        peak = trial.predicted["peak_gpu_bytes"]
        lack = peak - comp.budgets.gpu_bytes
        if attempt == RESOLVES:
            raise PlanError(f"GPU-updated blocks {list(blocks)} do not fit the GPU budget of "
                            f"{comp.budgets.gpu_bytes / 2**30:.2f} GiB: with them the plans re-solved with less "
                            f"memory for the rest still peak {peak / 2**30:.2f} GiB; ask for fewer (or 'auto')")
        if attempt == 0:        # what the blocks add to the solved plan's peak: the first re-solve leaves that
            gpu_bytes -= max(int(peak - base.predicted["peak_gpu_bytes"]), int(lack), 2**26)
        else:                   # the re-solved plan peaks elsewhere: leave what it still lacked, 64 MiB at least
            gpu_bytes -= max(int(lack), 2**26)
        if gpu_bytes <= 0:
            raise PlanError(f"GPU-updated blocks {list(blocks)} need more than the whole GPU budget; ask for fewer")
        base = _re_solved(search, gpu_bytes, policy, plan.batch_size, micro_batch)
        if base is None:
            raise PlanError(f"GPU-updated blocks {list(blocks)} do not fit the GPU budget: no plan leaves the "
                            f"{max(int(lack), 0) / 2**30:.2f} GiB they need; ask for fewer (or 'auto')")


def _warn_if_slower(forced: Plan, solved: Plan, blocks, resolved_bytes: int) -> None:
    """One warning where the GPU-updated blocks asked for make the plan predicted slower than the solved plan
    without them by more than ``FORCED_SLOWER``: a count that fits only beside a plan re-solved with much less
    memory drives that plan to small micro-batches (qwen2.5-3b at 24 GiB, batch 32 on the H200: 12 blocks,
    micro-batch 1, 4.06 s measured against the rule's 1.35 s)."""
    step, base = forced.predicted["step_time_s"], solved.predicted["step_time_s"]
    if step <= base * (1 + FORCED_SLOWER):
        return
    how = (f", which fit only beside a plan re-solved with {resolved_bytes / 2**30:.2f} GiB less GPU memory for the "
           f"rest (micro-batch {forced.micro_batch})" if resolved_bytes > 0 else "")
    warnings.warn(f"gpu_update: with the {len(blocks)} GPU-updated blocks asked for{how}, the plan is predicted at "
                  f"{step:.3f} s a step against {base:.3f} s without them; ask for fewer (or 'auto')",
                  stacklevel=caller_stacklevel())


def _re_solved(search, gpu_bytes: int, policy: str, batch_size: int, micro_batch: int | None = None,
               deadline: float | None = None) -> Plan | None:
    """The search's best plan with ``gpu_bytes`` of GPU budget, the memory GPU-updated blocks need set aside
    (within ``deadline`` CPU seconds, else the search's own).  Its warnings (a micro-batch where the MILP found
    nothing at that budget and a heuristic stood in) are about a budget the caller never gave, so they are not
    passed on; what the kept plan is, ``show`` says."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return search.with_gpu_budget(gpu_bytes, deadline=deadline).best(policy, batch_size, micro_batch)


def choose(search, plan: Plan) -> Plan:
    """The rule of the module docstring (``search``: the ``search.Search`` that found ``plan``; its compiler builds
    the plans); returns the fastest plan found, with what was tried in its notes.

    A GPU update takes work off the host and puts some on the GPU, so it can at best remove the time the GPU
    waits: a plan whose simulated GPU idles less than ``MIN_IDLE_SHARE`` of its step (GPU-bound, as most plans
    on the FLOP-modelled profiles are) is returned as it is, without the scans.  The solved plan's solver stats
    go with whichever plan is kept (a scan's plans are built, not solved)."""
    t0, comp = time.perf_counter(), search.comp
    step = plan.predicted["step_time_s"]
    if step - plan.predicted.get("busy_s", {}).get("gpu", 0.0) < MIN_IDLE_SHARE * step:
        return plan
    # the scans, the room and the re-solve, all together, within what the search left of the compile's deadline
    budget = [compile_cpu_seconds() + min(LIMITS.rule_s, search.deadline.after_cpu_left())]
    built: dict[tuple, Plan | None] = {}     # both scans' plans by their decisions: a re-solve often repeats many
    best, tried, over = _scan(comp, plan, budget, built)      # over: the first count that did not fit
    room = _room(comp, plan, over, budget, best.predicted["step_time_s"]) if over is not None else 0
    resolved = None
    left = budget[0] - compile_cpu_seconds()
    if room > MAX_ROOM_SHARE * comp.budgets.gpu_bytes:
        tried.append(["no re-solve", round(room / 2**30, 3)])
        room = 0
    if room > 0 and (comp.time_limit is not None or left >= 2 * LIMITS.min_rule_resolve_s):
        # the solved plan leaves too little memory: solve again with that much less, in at most half of what is
        # left (the other half scans its plan); a caller's time limit per solve has no deadline, as the search
        resolved = _re_solved(search, comp.budgets.gpu_bytes - room, "milp", plan.batch_size,
                              deadline=None if comp.time_limit is not None else left / 2)
    elif room > 0:
        tried.append(["no time to re-solve"])
    if resolved is not None:
        again, tried_again, _ = _scan(comp, resolved, budget, built, base_step=best.predicted["step_time_s"])
        tried += [["re-solved", round(room / 2**30, 3)], *tried_again]
        if again.predicted["step_time_s"] < best.predicted["step_time_s"] - MIN_GAIN_S:
            best = again
    note = {"rule": "fastest simulated step over (resident blocks given back, first streamed blocks GPU-updated)",
            "tried": tried, "blocks": sorted(best.decisions.gpu_updated_blocks),
            "resident": len(best.decisions.resident_blocks), "baseline_step_s": round(plan.predicted["step_time_s"], 5),
            "seconds": round(time.perf_counter() - t0, 3)}
    log.info("GPU-update rule: %d streamed blocks updated on the GPU, %d resident: %.3f s a step (searched %.3f)",
             len(note["blocks"]), note["resident"], best.predicted["step_time_s"], plan.predicted["step_time_s"])
    dec_noted = dataclasses.replace(best.decisions, notes={**best.decisions.notes, "gpu_update": note})
    return dataclasses.replace(best, decisions=dec_noted, solver=best.solver or plan.solver, history=[*best.history, {
        "pass": "gpu_update", "seconds": note["seconds"]}])     # a copy: the search's memo stays as it was


def _room(comp, plan: Plan, over: int, budget: list[float], best_step: float) -> int:
    """GPU bytes the plan would need beyond its budget for the GPU-updated blocks that would shorten its step
    most if memory were no object (the first streamed blocks, on the solved plan's other decisions), from
    ``over``, the first count that did not fit; 0 when more than ``over - 1`` blocks would not be faster, or
    not faster than ``best_step``, the scan's best, by ``LIMITS.rule_resolve_gain``: a plan re-solved with less memory
    for the rest is no faster than these blocks on the solved plan's decisions, the most a re-solve could reach."""
    g, dec = plan.graph, plan.decisions
    cands = candidates(g, dec)
    free = _Counts(lambda k: comp.build(with_blocks(dec, cands[:k], g.n_blocks), plan.batch_size,
                                        check_budget=False), budget, lambda k, p: None)
    try:      # every build here may find the budget spent (``over - 1``'s too, which ``_lowest`` may not build)
        k = _lowest(free, max(over - 1, 1), len(cands))
        step_fit = plan.predicted["step_time_s"] if over <= 1 else free.step(over - 1)
        if k < over or free.step(k) >= min(step_fit, best_step * (1 - LIMITS.rule_resolve_gain)) - MIN_GAIN_S:
            return 0
        return max(0, int(free.at(k).predicted["peak_gpu_bytes"] - plan.budgets["gpu_bytes"]))
    except _OutOfTime:
        return 0


class _OutOfTime(Exception):
    """The scans' CPU budget ran out."""


class _Counts:
    """The plans of one base decision with its first k candidate blocks GPU-updated, k = 1, 2, ...: built once
    each (``at``), None where it does not fit (``build`` returns None or raises ``PlanError``); ``step`` is the
    simulated step (infinite where it does not fit).
    Every build is reported to ``record(k, plan or None)``."""

    def __init__(self, build, budget: list[float], record):
        self.build, self.budget, self.record = build, budget, record
        self.plans: dict[int, Plan | None] = {}

    def at(self, k: int) -> Plan | None:
        if k not in self.plans:
            if compile_cpu_seconds() > self.budget[0]:
                raise _OutOfTime
            try:
                p = self.build(k)
            except PlanError:              # over a budget
                p = None
            self.plans[k] = p
            self.record(k, p)
        return self.plans[k]

    def step(self, k: int) -> float:
        p = self.at(k)
        return float("inf") if p is None else p.predicted["step_time_s"]


def _largest_fitting(counts: _Counts, n: int, hint: int) -> int:
    """The largest k in 0..n whose plan fits (more GPU-updated blocks only add memory, so the counts that fit
    are 1..k): galloping from ``hint`` (the previous d's, which the next one usually exceeds by a few blocks:
    hint + 1, + 2, + 4, ...), then bisection."""
    if n == 0 or counts.at(1) is None:
        return 0
    lo, hi = 1, n + 1                      # at(lo) fits; at(hi) does not (n + 1: never built)
    hint = min(max(hint, 1), n)
    if hint > 1:
        if counts.at(hint) is None:
            hi = hint
        else:
            lo = hint
    stride = 1
    while hi == n + 1 and lo < n:          # gallop up until a count does not fit
        probe = min(lo + stride, n)
        if counts.at(probe) is None:
            hi = probe
        else:
            lo = probe
        stride *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if counts.at(mid) is None:
            hi = mid
        else:
            lo = mid
    return lo


def _lowest(counts: _Counts, lo: int, hi: int) -> int:
    """The k in lo..hi with the shortest step, for a step that falls then rises with k (each GPU-updated
    block takes a host update off the step until the state copies or the GPU pace it): the end ``hi`` when
    the step still falls there (the usual case: memory stops the count first), else a ternary search."""
    if hi <= lo:
        return lo
    if counts.step(hi) < counts.step(hi - 1) - MIN_GAIN_S:
        return hi
    hi -= 1
    # the step usually turns a few blocks below where memory stops the count: walk down from there (each
    # count already built by the galloping costs nothing) before a ternary search over what is left
    for _ in range(WALK):
        if hi <= lo or counts.step(hi - 1) > counts.step(hi) + MIN_GAIN_S:
            return hi
        hi -= 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if counts.step(m1) <= counts.step(m2):
            hi = m2 - 1 if counts.step(m1) < counts.step(m2) else m2
        else:
            lo = m1 + 1
    return min(range(lo, hi + 1), key=counts.step)


def _best_count(counts: _Counts, n: int, hint: int) -> tuple[int, int | None]:
    """The best count of GPU-updated blocks in 0..n and the largest that fits (None where the search did not need
    it).  Counts 1, 2, ... are built in turn until ``K_PATIENCE`` in a row bring nothing or one does not fit (the
    step turned before memory stopped it); if it still falls after ``LINEAR`` counts, the largest count that fits
    is found by galloping and bisection (``_largest_fitting``) and the best between by ``_lowest``: the step
    falls by about one host update per block until memory stops it, so a long fall costs ~2 log2 of its length
    in builds, not its length."""
    best_k, best_s, misses = 0, float("inf"), 0
    for k in range(1, n + 1):
        s = counts.step(k)
        if s == float("inf"):
            return best_k, k - 1
        if s < best_s - MIN_GAIN_S:
            best_k, best_s, misses = k, s, 0
        else:
            misses += 1
            if misses >= K_PATIENCE:
                return best_k, None
        if k >= LINEAR and best_k == k and k < n:
            kmax = _largest_fitting(counts, n, max(hint, k + 1))
            return _lowest(counts, k, kmax), kmax
    return best_k, n


def _built(comp, dec: Decisions, batch_size: int, built: dict[tuple, Plan | None]) -> Plan | None:
    """``comp.build(dec, batch_size)``, once per decision in ``built`` (None: over a budget): the scan of a
    re-solved plan meets many plans of the first scan's (qwen3-8b at 48 GiB, batch 8: a re-solve with 4 GiB
    less kept 15 resident blocks where the first scan gave back 2 of 17, and its scan built 30 of the first's
    plans again)."""
    key = (dec.micro_batch, dec.n_micro, dec.boundary, dec.saved, dec.cut, dec.resident_blocks,
           dec.gpu_updated_blocks)
    if key not in built:
        try:
            built[key] = comp.build(dec, batch_size)
        except PlanError:
            built[key] = None
    return built[key]


def _scan(comp, plan: Plan, budget: list[float], built: dict[tuple, Plan | None],
          base_step: float | None = None) -> tuple[Plan, list, int | None]:
    """The scan over (d, k) from ``plan`` (module docstring): the fastest plan (``plan`` itself unless one is
    faster than it and than ``base_step``), the (resident blocks, k, step or None) built (``built``: every
    plan built so far, by its decisions), and the first count that did not fit at d = 0 (None if every
    candidate fit or the time ran out first).

    For each d the best count comes from ``_best_count``: one by one while the step turns early, by galloping
    and bisection over a long fall."""
    g, dec = plan.graph, plan.decisions
    best, best_step = plan, plan.predicted["step_time_s"]
    bar = best_step if base_step is None else min(best_step, base_step)
    tried: list[list] = [[len(dec.resident_blocks), 0, round(best_step, 5)]]
    trade = _tradeable(g, dec)
    stale_d, hint, first_over, fitted = 0, 2, None, -1
    for d in range(len(trade) + 1):
        res = dec.resident_blocks - set(trade[:d])
        base = dataclasses.replace(dec, resident=tuple(j in res for j in range(g.n_blocks)) if res else ())
        cands = candidates(g, base)
        n_res = len(res)

        def build(k: int, base=base, cands=cands) -> Plan | None:
            return _built(comp, with_blocks(base, cands[:k], g.n_blocks), plan.batch_size, built)

        def record(k: int, p: Plan | None, n_res=n_res) -> None:
            tried.append([n_res, k, None if p is None else round(p.predicted["step_time_s"], 5)])
        counts = _Counts(build, budget, record)
        try:
            if d and fitted >= LINEAR:      # the last d's step fell past LINEAR counts: start where it ended
                kmax = _largest_fitting(counts, len(cands), hint)
                k = _lowest(counts, 1, kmax) if kmax else 0
            else:
                k, kmax = _best_count(counts, len(cands), hint)
        except _OutOfTime:
            tried.append(["out of time"])
            return best, tried, first_over
        if kmax is not None:
            hint = max(hint, kmax)
            if d == 0 and kmax < len(cands):
                first_over = kmax + 1
        improved = bool(k) and counts.step(k) < min(best_step, bar) - MIN_GAIN_S
        if improved:
            best, best_step = counts.at(k), counts.step(k)
        # until a d first shortens the step, one that fits more blocks than the last is progress too (the first
        # blocks a given-back resident block makes room for may not pay: their state copies; more do), but only
        # while memory is what stops the count (its step still falls at the largest count that fits): where the
        # step turns before that, more room buys nothing (qwen2.5-7b at 80 GiB, batch 8: each d fits one more
        # block and its best step is the solved plan's, through all 25 resident blocks)
        grew = best is plan and kmax is not None and kmax > fitted and k == kmax
        fitted = max(fitted, kmax or 0)
        stale_d = 0 if improved or grew else stale_d + 1
        if stale_d >= D_PATIENCE:
            break
    return best, tried, first_over
