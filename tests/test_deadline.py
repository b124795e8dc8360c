"""The search deadline and each solve's limit count the CPU time the compile gets, so that a loaded machine
does not change the plan; a wall-clock backstop still ends a starved compile and says so."""

import random

import pytest

from lazytrain.compiler import deadline as dl
from lazytrain.compiler.solvers import isolated
from lazytrain.compiler.solvers.lp import LinearModel, xsum


class Clocks:
    """CPU and wall seconds a test moves by hand."""

    def __init__(self):
        self.cpu = self.wall = 0.0


@pytest.fixture
def clocks(monkeypatch):
    c = Clocks()
    monkeypatch.setattr(dl, "compile_cpu_seconds", lambda: c.cpu)
    monkeypatch.setattr(dl.time, "monotonic", lambda: c.wall)
    monkeypatch.setattr(dl.time, "perf_counter", lambda: c.wall)
    return c


def test_wall_time_without_cpu_time_does_not_end_the_search(clocks):
    """A machine other work shares: wall time passes, the compile gets little CPU; the deadline holds until
    the compile has had its CPU seconds, and a solve's limit is what is left of them."""
    d = dl.Deadline(4.0)
    d.start()
    clocks.wall += 12.0          # three times the deadline, a load of 3 on the compile's core
    clocks.cpu += 3.0
    assert d.has(0.5) and d.stopped_by == ""
    assert d.solve_limit(10.0) == pytest.approx(1.0) and d.binding == "cpu"
    clocks.cpu += 0.6
    assert not d.has(0.5) and d.stopped_by == "cpu"


def test_a_starved_compile_stops_at_the_wall_clock_backstop(clocks):
    d = dl.Deadline(4.0)
    d.start()
    clocks.wall += isolated.WALL_FACTOR * 4.0 - 1.0     # hardly any CPU time in all that wall time
    clocks.cpu += 0.5
    assert d.solve_limit(10.0) == pytest.approx(1.0 / isolated.WALL_FACTOR) and d.binding == "wall"
    assert not d.has(1.5) and d.stopped_by == "wall"
    d.start()                    # the next question of the caller's counts afresh
    assert d.has(1.5) and d.stopped_by == ""


def test_a_build_is_set_aside_on_both_clocks(clocks):
    d = dl.Deadline(4.0)
    d.start()
    cpu, wall = clocks.cpu, clocks.wall
    clocks.cpu, clocks.wall = 1.0, 3.0
    d.timed(cpu, wall)
    assert d.build_cpu == 1.0 and d.build_wall == 3.0
    assert d.cpu_left() == pytest.approx(2.0) and d.wall_left() == pytest.approx(16.0 - 6.0)


def test_no_deadline_never_runs_out(clocks):
    d = dl.Deadline(None)
    d.start()
    clocks.cpu = clocks.wall = 1e6
    assert d.has(100.0) and d.solve_limit(3.0) == 3.0


def _knapsacks(n: int = 120, rows: int = 30, seed: int = 1) -> LinearModel:
    """Binary multi-knapsack: too hard for HiGHS or CBC to prove optimal in a fraction of a second."""
    rng = random.Random(seed)
    m = LinearModel()
    x = [m.binary(f"x[{i}]") for i in range(n)]
    for r in range(rows):
        m += xsum(rng.randint(1, 50) * xi for xi in x) <= 500, f"knapsack[{r}]"
    m.objective = xsum(-rng.randint(10, 100) * xi for xi in x)
    return m


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_a_solve_stops_when_its_cpu_seconds_are_spent(solver):
    """The worker stops the solver once the solve has used its CPU time limit (HiGHS's own limit counts wall
    time: an interrupt does it; CBC is told to count CPU time), answers with the incumbent, and reports the
    CPU seconds it spent, which the compile's clock adds."""
    before = isolated.solver_cpu_seconds()
    r = isolated.solve(_knapsacks(), order=(solver,), time_limit=0.3, gap=1e-9)
    assert r.status == "feasible" and r.gap > 0
    # stopped by its CPU time, not by a wall second (unless a machine more than WALL_FACTOR times oversubscribed
    # hit the backstop first)
    assert 0.3 <= r.cpu_s < 0.3 + 0.5 or (r.cpu_s < 0.3 and r.seconds >= isolated.WALL_FACTOR * 0.3)
    assert isolated.solver_cpu_seconds() - before == pytest.approx(r.cpu_s)


def test_a_compiled_block_counts_once_per_cut_in_the_search_budget():
    """Cuts add binaries per block: a 30-layer chain is short (the 4 s budget and deadline), the same chain
    with four cuts a layer (what compiled blocks offer) gets the long ones."""
    import dataclasses

    from lazytrain.compiler import search
    from lazytrain.compiler.api import Compiler, make_budgets
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.compiler.search import Search
    from lazytrain.compiler.synthetic import chain
    from lazytrain.compiler.time_limits import LIMITS
    from lazytrain.ir import Cut

    g = chain(30)
    def cuts(b):
        return tuple(Cut(budget=x, saved_bytes=int(b.saved_bytes * x)) for x in (1.0, 0.7, 0.35, 0.0))
    cut = dataclasses.replace(g, blocks=tuple(dataclasses.replace(b, cuts=cuts(b)) if b.kind == "layer" else b
                                              for b in g.blocks))
    assert search.milp_size(g) == 32 and search.milp_size(cut) == 2 + 4 * 30
    hw = get_profile("h200")
    sizes = {}
    for name, graph in (("plain", g), ("cut", cut)):
        comp = Compiler(graph, hw, make_budgets(hw, "24GiB", "200GiB", None, None, None), param_dtype="bfloat16",
                        optimizer="hybrid8bit", clip=True)
        asked = Search(comp)
        sizes[name] = (asked.solver_left, asked.deadline.seconds)
    assert sizes == {"plain": (LIMITS.short_solver_s, LIMITS.short_deadline_s),
                     "cut": (LIMITS.solver_s, LIMITS.deadline_s)}


def test_the_deadline_counts_the_gpu_update_rule_after_the_search():
    """Where the GPU-update rule follows the search, the compile's deadline holds both: a long chain's search
    leaves the rule ``LIMITS.rule_reserve_s`` of its deadline, a short chain's gets the rule's time on top of its own,
    a caller's deadline leaves the rule at most half; without the rule the search has the whole deadline."""
    from lazytrain.compiler.api import Compiler, make_budgets
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.compiler.search import Search
    from lazytrain.compiler.synthetic import chain
    from lazytrain.compiler.time_limits import LIMITS

    hw = get_profile("h200")

    def deadline(n_blocks, **kw):
        comp = Compiler(chain(n_blocks), hw, make_budgets(hw, "24GiB", "200GiB", None, None, None),
                        param_dtype="bfloat16", optimizer="hybrid8bit", clip=True, **kw)
        d = Search(comp).deadline
        d.start()
        return d.seconds, d.reserve, d.cpu_left(), d.after_cpu_left()

    long, short = LIMITS.short_chain_blocks + 8, 12
    seconds, reserve, search_left, all_left = deadline(long, rule_follows=True)
    assert (seconds, reserve) == (LIMITS.deadline_s, LIMITS.rule_reserve_s)
    assert search_left == pytest.approx(seconds - reserve, abs=0.2) and all_left == pytest.approx(seconds, abs=0.2)
    assert deadline(short, rule_follows=True)[:2] == (LIMITS.short_deadline_s + LIMITS.short_rule_reserve_s,
                                                     LIMITS.short_rule_reserve_s)
    assert deadline(short, rule_follows=True, deadline=3.0)[:2] == (3.0, 1.5)
    assert deadline(long, rule_follows=True, deadline=30.0)[:2] == (30.0, LIMITS.rule_reserve_s)
    assert deadline(long)[:2] == (LIMITS.deadline_s, 0.0)
    assert deadline(long, rule_follows=True, time_limit=1.0)[:2] == (None, 0.0)
