"""The search over plans a compile runs: per policy, the best micro-batch; for the MILP, solves
warm-started from the best heuristic, checked in time order after lowering (no-good cuts, then a
tightened budget), with a fallback when the solver fails; and the largest batch that fits.

Every plan returned is memoized and never mutated afterwards: a plan adapted for another answer
(the heuristic plan that stands in for a failed solve, with its note) is a copy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from ..frontend.validate import micro_batch_candidates
from ..ir import Decisions, OpKind, Place, Plan, PlanError, Saved, SolverStats
from .deadline import Deadline, compile_cpu_seconds
from .options import Policy
from .progress import log
from .solvers import isolated
from .solvers.heuristics import HEURISTICS
from .solvers.milp import MilpOptions, coefficients, solve
from .time_limits import LIMITS

#: no-good-cut re-solves per micro-batch before the budget is tightened: 16 short chains, 0 long
#: [ledger: search-no-good-cuts]
NO_GOOD_CUTS_SHORT, NO_GOOD_CUTS_LONG = 16, 0
#: budget tightenings per micro-batch after the no-good cuts: 5 [ledger: search-tightening]
TIGHTENINGS = 5
def _deadline(comp, short: bool) -> Deadline:
    """The compile's planning deadline (``LIMITS.deadline_s``): the caller's, else the default unless the caller set a
    time limit per solve (then each solve takes it whole), else none; with the rule's reserve where it follows."""
    seconds = (comp.deadline if comp.deadline is not None else
               None if comp.time_limit is not None else LIMITS.short_deadline_s if short else LIMITS.deadline_s)
    if seconds is None or not comp.rule_follows:
        return Deadline(seconds)
    reserve = LIMITS.short_rule_reserve_s if short else LIMITS.rule_reserve_s
    if comp.deadline is not None:
        return Deadline(seconds, min(reserve, seconds / 2))
    return Deadline(seconds + reserve, reserve) if short else Deadline(seconds, reserve)


def milp_size(graph) -> int:
    """The MILP's size in blocks: a block counts once per cut it may run at (its binaries are per cut), so a
    compiled-blocks graph (``Block.cuts``: 4 per layer) counts as the larger model its binaries make it."""
    return sum(max(1, len(b.cuts)) for b in graph.blocks)


def _step(p: Plan) -> float:
    return p.predicted["step_time_s"]


def _peaks_under_drain(plan: Plan, sim) -> bool:
    """Does ``plan``'s time-ordered GPU memory peak while a block's gradients drain to the host?"""
    if not sim.memory:
        return False
    t_peak = max(sim.memory, key=lambda e: e[1])[0]
    return any(op.kind is OpKind.GRAD_OFFLOAD and sim.start[op.id] <= t_peak < sim.end[op.id] for op in plan.ops)


def _out_of_time(plan: Plan, stats: SolverStats) -> Plan:
    """A copy of ``plan`` (memoized) with ``stats``, which say the search's deadline ran out after it."""
    return dataclasses.replace(plan, solver=stats, history=list(plan.history))


def _no_milp_plan(plan: Plan | None) -> bool:
    """Whether ``milp_at`` found nothing at a micro-batch no heuristic fits: no plan, or only the frugal warm start.
    (Not where a heuristic stands in: one more solve there spent the deadline of a search that ran out of it --
    llama3-8b at 48 GiB, batch 8, predicted 1.412 s against 1.384.)"""
    return plan is None or (plan.decisions.policy == "frugal" and bool(plan.decisions.notes.get("milp_failed")))


def _said(plan: Plan | None) -> str:
    """One micro-batch's result, as the compile's progress says it."""
    if plan is None:
        return "no plan in budget"
    st = plan.solver
    if plan.decisions.policy == "milp":
        how = f"{st.solver} {st.status}" + (f", gap {st.gap:.1%}" if st.gap is not None else "") if st else "MILP"
        return f"{_step(plan):.3f} s a step ({how})"
    why = plan.decisions.notes.get("milp_fallback", "")
    return f"{_step(plan):.3f} s a step, the {plan.decisions.policy} plan" + (f" ({why})" if why else "")


def _with_note(plan: Plan, note: str, stats: SolverStats | None, failed: bool = False) -> Plan:
    """A copy of ``plan`` (a memoized heuristic plan) standing in for the MILP, saying why; ``failed``: the MILP gave
    no plan there (note ``milp_failed``), rather than one the heuristic beat."""
    notes = {**plan.decisions.notes, "milp_fallback": note, **({"milp_failed": True} if failed else {})}
    dec = dataclasses.replace(plan.decisions, notes=notes)
    return dataclasses.replace(plan, decisions=dec, solver=stats, history=list(plan.history))


def tightening(excess: int, last: tuple[int, int]) -> tuple[int, int]:
    """(bytes to take off the MILP rows' GPU budget, ``excess``) after a plan peaked ``excess`` bytes over the budget
    in time order, given the ``last`` tightening and the excess that caused it ((0, 0): none yet).

    The rows' error at a plan's peak is not always the one at the last plan's: where the last tightening lowered
    the excess by less than half its own size, the peak lies where the rows do not reach it at that budget (e.g.
    activations queued behind a busy D2H copy engine while the GPU runs ahead), and stepping by the excess alone
    creeps: qwen2.5-3b at 24 GiB, batch 32, calibrated, went 3.13 GiB, then 0.08, 0.09 with the peak 21.37, 21.38
    GiB over a 21.30 budget, and fell to megatrain.  Then the step is twice the last (the bracket grown); that
    plan fit at the next solve (20.55 GiB, 1.402 s against megatrain's 1.933)."""
    step = int(excess * 1.05) + 1
    if last[0] and last[1] - excess < last[0] / 2:
        step = max(step, 2 * last[0])
    return step, excess


class Search:
    """The questions about the plans of one compiler (``builder.Compiler``: graph, hardware, budgets, options), each
    answer memoized: the best plan of a policy, the largest batch, the frugal and leanest plans, the micro-batches to
    try.  The compiler builds the plans it asks for and never asks it anything back."""

    def __init__(self, comp):
        self.comp = comp
        self._memo: dict[tuple, Plan | None] = {}
        #: (policy, batch, micro-batch) -> its heuristic plan, or None where it does not fit: the heuristics at every
        #: micro-batch and at one given micro-batch ask for the same plans (llama3-8b 24 GiB, batch 72: 0.27 s twice)
        self._heuristic: dict[tuple[str, int, int], Plan | None] = {}
        #: solver failures met in this search (the caller warns once)
        self.failures: list[str] = []
        short = milp_size(comp.graph) <= LIMITS.short_chain_blocks
        #: CPU seconds this search and the GPU-update rule after it may take (``_deadline``), counted per question
        #: of the caller's
        self.deadline = _deadline(comp, short)
        #: solver seconds left to this search (``LIMITS.solver_s``, in proportion where the search's part of the
        #: deadline is shorter than the default, so that the micro-batches' even shares fit it
        #: [ledger: search-solver-budget]); unused when the caller set a time limit
        budget, full = ((LIMITS.short_solver_s, LIMITS.short_deadline_s) if short
                        else (LIMITS.solver_s, LIMITS.deadline_s))
        searched = self.deadline.search_seconds()
        self.solver_left = budget if searched is None else min(budget, budget * searched / full)
        self._tries_left = 1      # micro-batches the MILP search still means to try (shares the budget)
        self._depth = 0                          # questions in progress (the MILP's asks the heuristics')
        self.ran_out = False      # a solve or re-solve was skipped for the deadline

    def with_gpu_budget(self, gpu_bytes: int, deadline: float | None = None) -> Search:
        """A search of its own over this compiler with another GPU budget (``Compiler.with_gpu_budget``)."""
        return Search(self.comp.with_gpu_budget(gpu_bytes, deadline=deadline))

    def micro_batches(self, batch_size: int, micro_batch: int | None) -> list[int]:
        """Candidate micro-batch sizes, largest first: the given one, else divisors of the batch
        up to 32 whose op list stays bounded (``validate.micro_batch_candidates``)."""
        return micro_batch_candidates(batch_size, self.comp.graph.n_blocks, micro_batch)

    def solve_limit(self) -> float:
        """The next solve's limit before the deadline's cut: the caller's, else this micro-batch's share of the
        solver seconds left (at least ``LIMITS.min_solve_s``)."""
        if self.comp.time_limit is not None:
            return self.comp.time_limit
        share = self.solver_left / max(1, self._tries_left)
        return max(LIMITS.min_solve_s, min(self.comp.solve_time_limit(), share))

    def time_limit(self) -> float:
        """The next solve's limit, cut so that the solve and its plan's build end by the deadline."""
        return self.deadline.solve_limit(self.solve_limit())

    def can_solve(self) -> bool:
        """Is there time for one more solve (``LIMITS.min_solve_s``, or the caller's limit if shorter) and its
        build before the deadline?  No: the search stops and says so."""
        if self.deadline.has(min(LIMITS.min_solve_s, self.comp.time_limit or LIMITS.min_solve_s)):
            return True
        self.ran_out = True
        return False

    def build(self, decisions: Decisions, batch_size: int, *, check_budget: bool = True, simulated: bool = False):
        """``Compiler.build`` (``build_simulated`` when ``simulated``), timed: the slowest build so far is what
        a solve leaves time for before the deadline (a solution is built to be checked)."""
        cpu, wall = compile_cpu_seconds(), time.perf_counter()
        try:
            out = self.comp.build_simulated(decisions, batch_size, check_budget=check_budget)
        finally:
            self.deadline.timed(cpu, wall)
        return out if simulated else out[0]

    def out_of_time(self) -> bool:
        return ((self.comp.time_limit is None and self.solver_left <= 0) or self.deadline.cpu_left() <= 0
                or self.deadline.wall_left() <= 0)

    def _cut_short(self) -> None:
        """The deadline cut a solve short: the search ran out, on the clock that bounded the solve's limit."""
        self.ran_out = True
        self.deadline.stopped_by = self.deadline.stopped_by or self.deadline.binding

    def _stats_out_of_time(self, stats: SolverStats | None) -> SolverStats:
        """``stats`` marked: the deadline stopped the search, on the clock that ran out."""
        return dataclasses.replace(stats or SolverStats(status="not_solved"), out_of_time=True,
                                   deadline_clock=self.deadline.stopped_by or "cpu")

    # -- any policy ------------------------------------------------------------------------------
    def best(self, policy: str, batch_size: int, micro_batch: int | None = None, tries: int = 2) -> Plan | None:
        """Best feasible plan of ``policy`` over micro-batch sizes (the given one only, if given)."""
        policy = Policy.parse(policy, "unknown policy").value
        key = (policy, batch_size, micro_batch, tries)
        if key not in self._memo:
            if self._depth == 0:        # a question of the caller's, not one the search asks itself
                self.deadline.start()
                self.ran_out = False
            self._depth += 1
            try:
                self._memo[key] = (self.best_milp(batch_size, micro_batch) if policy == "milp"
                                   else self.best_heuristic(policy, batch_size, micro_batch, tries))
            finally:
                self._depth -= 1
        return self._memo[key]

    def best_heuristic(self, policy: str, batch_size: int, micro_batch: int | None, tries: int) -> Plan | None:
        """Larger micro-batches run the GPU more efficiently and memory grows with them, so
        feasibility is monotone: bisect for the largest feasible one, then compare it with the next
        ``tries - 1`` smaller ones.  The bisection builds the smallest micro-batch only when no larger one
        fits: its op list is the longest (72 micro-batches of an 80-block model: 24,000 ops, ~1.5 s)."""
        cands = self.micro_batches(batch_size, micro_batch)          # largest first
        built: dict[int, Plan | None] = {}

        def plan_at(i: int) -> Plan | None:
            mb = cands[i]
            if mb not in built:
                built[mb] = self.heuristic_plan(policy, batch_size, mb)
            return built[mb]

        lo, hi = 0, len(cands)           # the first feasible index is in [lo, hi]; hi: none is
        while lo < hi:
            mid = (lo + hi) // 2
            if plan_at(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(cands):
            return None
        for i in range(lo, min(lo + tries, len(cands))):
            plan_at(i)
        return min((p for p in built.values() if p is not None), key=_step)

    def heuristic_plan(self, policy: str, batch_size: int, mb: int) -> Plan | None:
        """``policy``'s plan at micro-batch ``mb`` built and checked against the budgets (None: it does not fit)."""
        key = (policy, batch_size, mb)
        if key not in self._heuristic:
            t = time.perf_counter()
            try:
                dec = self.comp.with_resident(HEURISTICS[policy](self.comp.graph, mb, batch_size // mb))
                plan = self.build(dec, batch_size)
                plan.history.append({"pass": f"{policy} micro-batch {mb}: decide+lower+verify+simulate",
                                     "seconds": round(time.perf_counter() - t, 4)})
            except PlanError:
                plan = None
            self._heuristic[key] = plan
        return self._heuristic[key]

    def heuristics(self, batch_size: int, micro_batch: int | None) -> list[Plan]:
        """The heuristic policies' best plans, fastest first."""
        plans = [p for pol in HEURISTICS if (p := self.best(pol, batch_size, micro_batch)) is not None]
        return sorted(plans, key=_step)

    # -- the MILP ------------------------------------------------------------------------------
    def best_milp(self, batch_size: int, micro_batch: int | None, top: int = 2) -> Plan | None:
        """Heuristics over every candidate micro-batch (cheap), then the MILP at the ``top`` most
        promising ones, warm-started from the best heuristic there, and at one larger micro-batch than
        any heuristic fits (the MILP may fit it by offloading).  Never worse than the heuristic: if
        the solver's plan simulates slower, or the solver fails, the heuristic's plan is returned."""
        by_mb: dict[int, Plan] = {}
        for p in self.heuristics(batch_size, micro_batch):
            by_mb.setdefault(p.micro_batch, p)
        cands = self.micro_batches(batch_size, micro_batch)
        tries = [(mb, by_mb[mb]) for mb in list(by_mb)[:top]]
        if by_mb and len(tries) < top:
            # the heuristics agree on one micro-batch: also try the next smaller one, where the MILP
            # may keep more activations and so beat the larger micro-batch
            smaller = [mb for mb in cands if mb < next(iter(by_mb))][:top - len(tries)]
            tries += [(mb, (self.heuristics(batch_size, mb) or [None])[0]) for mb in smaller]
        top_mb = max(by_mb) if by_mb else 0
        larger = sorted(mb for mb in cands if mb > top_mb)
        if self.comp.progress:
            h = next(iter(by_mb.values()), None)
            mbs = [str(mb) for mb, _ in tries] + (["one larger" if tries else str(larger[0])] if larger else [])
            log.info("batch %d: %s; solving the MILP at micro-batch %s", batch_size,
                     f"best heuristic plan {_step(h):.3f} s a step ({h.decisions.policy}, micro-batch "
                     f"{h.micro_batch})" if h else "no heuristic plan fits", ", then ".join(mbs))
        best: Plan | None = None
        extra = 0
        while tries or (larger and extra < 1):
            if best is not None and not self.can_solve():
                if self.comp.progress:
                    log.info("the search's deadline ran out: the best plan so far")
                return _out_of_time(best, self._stats_out_of_time(best.solver))      # the best plan so far
            if not tries and best is not None and self.out_of_time():
                break            # the budget is spent: no larger micro-batch
            self._tries_left = len(tries) + (1 if larger and extra < 1 else 0)
            mb, warm = tries.pop(0) if tries else (larger.pop(0), None)
            grown = warm is None
            if warm is None:
                # no heuristic fits here: the frugal plan, when it fits, is the solver's warm start and the floor
                # (a hard model could otherwise end with no plan where one exists: llama3-70b, 48 GiB, batch 32)
                warm = self.frugal_plan(batch_size, mb)
            plan = self.milp_at(batch_size, mb, warm)
            if _no_milp_plan(plan) and self.comp.choose_resident and self.can_solve():
                # resident blocks hold their memory all step: without them is the leaner space, which the
                # rows' misjudged peaks may leave as the only one with a plan in budget (a 4-layer Mixtral at 24
                # GiB, batch 8: 17 plans with the embedding resident peaked 0.5-2.8 GiB over; streamed, one fit)
                plan = self.milp_at(batch_size, mb, warm, choose_resident=False)
            if self.comp.progress:
                log.info("micro-batch %d: %s", mb, _said(plan))
            if plan is None:
                if grown:
                    larger = []          # feasibility is monotone in the micro-batch: stop growing
                continue
            if grown:
                extra += 1
            if best is None or _step(plan) < _step(best):
                best = plan
        return best

    def milp_at(self, batch_size: int, mb: int, warm: Plan | None, choose_resident: bool | None = None) -> Plan | None:
        """The MILP's plan at one micro-batch, checked in time order, or ``warm`` where that is
        faster or the MILP has none; ``choose_resident``: whether the solver chooses resident blocks (default:
        the compiler's choice)."""
        comp = self.comp
        t = time.perf_counter()
        n_micro = batch_size // mb
        drain = False        # the rows for an offloaded block's backward under the next block's drain
        def opts() -> MilpOptions:
            return MilpOptions(clip=comp.clip, order=comp.solver_order, time_limit=self.time_limit(),
                               resident=comp.resident,
                               choose_resident=comp.choose_resident if choose_resident is None else choose_resident,
                               drain_under_reloads=drain)
        plan, stats, why = None, None, "the heuristic warm start simulated faster"
        excluded: list[Decisions] = []
        budget = comp.budgets.gpu_bytes
        last = (0, 0)        # the last tightening of the rows' budget, and the excess that caused it
        n_cuts = NO_GOOD_CUTS_SHORT if comp.graph.n_blocks <= 12 else NO_GOOD_CUTS_LONG
        coef = coefficients(comp.cost(mb, frozenset()), comp.budgets, n_micro, comp.options["host_bytes_per_param"],
                            state_on_nvme=comp.state_on_nvme())
        for attempt in range(n_cuts + TIGHTENINGS):
            if not self.can_solve():
                why = "the search deadline ran out" + (" before the solver found a plan in budget" if attempt else "")
                break
            try:
                c_solve = compile_cpu_seconds()
                try:
                    o = opts()
                    cut = o.time_limit < self.solve_limit()      # by the deadline
                    dec, stats = solve(coef, o, micro_batch=mb, warm=warm.decisions if warm else None,
                                       exclude=tuple(excluded))
                finally:
                    self.solver_left -= compile_cpu_seconds() - c_solve
                if stats.status != "optimal" and cut:
                    self._cut_short()
            except isolated.SolverFailure as e:
                self.failures += [f for f in e.failures if f not in self.failures]
                stats = SolverStats(status="solver failed", failures=tuple(e.failures))
                why = f"the MILP solvers failed ({e})"
                break
            except PlanError as e:
                why = f"the MILP gave no plan ({e})"
                stats = getattr(e, "stats", stats)
                if cut:
                    self._cut_short()
                break
            trial, sim = self.build(dec, batch_size, check_budget=False, simulated=True)
            excess = trial.predicted["peak_gpu_bytes"] - comp.budgets.gpu_bytes
            if excess <= 0:
                plan = trial if comp.within_budgets(trial) else None
                break
            why = (f"the MILP's plans peaked over the GPU budget in time order ({attempt + 1} solves, the last "
                   f"{excess / 2**30:.2f} GiB over)")
            # over budget in time order: where the peak is under a block's gradient drain, which the rows take
            # as certain only where nothing is reloaded, add the rows that take it for reloaded blocks too (one
            # re-solve: every such assignment, not this one only); else first exclude this assignment (exact:
            # the next best one is tried), then, if that keeps failing, tighten the window model's budget
            if not drain and _peaks_under_drain(trial, sim):
                drain = True
            elif attempt < n_cuts:
                excluded.append(dec)
            else:
                last = tightening(excess, last)
                budget -= last[0]
                coef = coefficients(comp.cost(mb, frozenset()), comp.budgets, n_micro,
                                    comp.options["host_bytes_per_param"], gpu_bytes=budget,
                                    state_on_nvme=comp.state_on_nvme())
        if self.ran_out:
            stats = self._stats_out_of_time(stats)
        if warm is not None and (plan is None or _step(warm) < _step(plan)):
            # the caller warns where the plan it returns is this one (``api.compile_model``), not for every
            # micro-batch the search tried and left
            failed = plan is None and stats is not None and stats.status != "solver failed"
            return _with_note(warm, f"{why}: {warm.decisions.policy} plan used", stats, failed)
        if plan is None:
            return None
        plan.solver = stats
        plan.history.append({"pass": f"milp micro-batch {mb}: solve+lower+verify+simulate",
                             "seconds": round(time.perf_counter() - t, 4)})
        return plan

    # -- the batch -----------------------------------------------------------------------------
    def frugal(self, batch_size: int, micro_batch: int, saved: Saved = Saved.RECOMPUTE) -> Decisions:
        """A frugal plan of the MILP's space: every block's saved tensors recomputed (or all ``saved`` there: the
        host), boundaries on the host."""
        L = self.comp.graph.n_blocks
        return self.comp.with_resident(Decisions(policy="frugal", micro_batch=micro_batch,
                                                 n_micro=batch_size // micro_batch,
                                                 boundary=(Place.HOST,) * L, saved=(saved,) * L))

    def frugal_plans(self, batch_size: int, micro_batch: int, check_budget: bool = True) -> Iterator[Plan]:
        """The frugal plans that build (and, with ``check_budget``, fit), each built as it is asked for: every block
        recomputed, then every block's saved tensors on the host.  Which needs less GPU memory depends on the
        blocks: a recompute holds its block's forward and backward transients at once, a reload does not (a 4-layer
        Mixtral-8x7B at micro-batch 1: 22.97 GiB recomputed, 19.97 offloaded)."""
        for saved in (Saved.RECOMPUTE, Saved.HOST):
            try:
                yield self.build(self.frugal(batch_size, micro_batch, saved), batch_size, check_budget=check_budget)
            except PlanError:
                continue

    def frugal_plan(self, batch_size: int, micro_batch: int) -> Plan | None:
        """The first frugal plan that fits the budgets (``frugal_plans``; the second is not built where the first
        fits: the max-batch bisection asks this at every batch it tries), or None where neither does."""
        return next(self.frugal_plans(batch_size, micro_batch), None)

    def leanest(self, batch_size: int, micro_batch: int | None) -> Plan:
        """The leaner on GPU memory of the frugal plans, built without budgets (``frugal_plans``: every block
        recomputed, or every block's saved tensors on the host; boundaries on the host), at the smallest
        micro-batch, with the blocks asked to be resident (they hold their memory whatever else the plan does).
        Both lie in the MILP's space; a plan mixing the two per block may need less still, so "needs at least" is
        a bound of these two, not of every plan."""
        mb = micro_batch or 1
        plans = list(self.frugal_plans(batch_size, mb, check_budget=False))
        if not plans:      # neither builds: the recompute's own error says why
            return self.build(self.frugal(batch_size, mb), batch_size, check_budget=False)
        return min(plans, key=lambda p: p.predicted["peak_gpu_bytes"])

    def max_batch(self, policy: str, micro_batch: int | None, limit: int) -> tuple[Plan | None, int]:
        """(plan, batch) for the largest batch (at most ``limit``) with a feasible plan: doubling, then
        bisection (feasibility is monotone in the batch for a fixed micro-batch, and in the micro-batch).  For
        the MILP, a batch is feasible when its most frugal plan fits: that plan lies in the MILP's space.

        With ``micro_batch``, the largest multiple of it; without, the largest batch one micro-batch holds:
        with gradient accumulation any batch whose boundaries the host holds fits (qwen2.5-0.5b at 24 GiB:
        tens of thousands of samples, each candidate an op list of as many micro-batches -- the search did not
        end in two minutes), at a step as long as the batch."""
        step = micro_batch or 1
        limit = max(step, limit // step * step)

        def feasible(b: int) -> bool:
            mb = step if micro_batch else b
            if policy == "milp":
                return self.frugal_plan(b, mb) is not None
            return self.best(policy, b, mb) is not None

        lo, hi = 0, step
        while feasible(hi):
            lo = hi
            if lo >= limit:
                break
            hi = min(hi * 2, limit)
        if lo == 0:
            return None, step
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            if mid <= lo:
                break
            lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
        plan = self.best(policy, lo, micro_batch)
        if plan is None:
            return None, lo
        within = f" of micro-batches of {micro_batch}" if micro_batch else " in one micro-batch"
        note = (f"largest feasible batch{within} {lo} (next {lo + step} does not fit)" if lo < limit
                else f"batch {lo}: the search's limit; larger may fit")
        dec = dataclasses.replace(plan.decisions, notes={**plan.decisions.notes, "batch_search": note})
        return dataclasses.replace(plan, decisions=dec, history=list(plan.history)), lo
