"""The MILP: optimal where brute force can check it, agrees with the simulator, never worse than
a heuristic, and fast enough for 80 layers."""

import itertools
from functools import cache

import pytest

from lazytrain.compiler.api import Compiler, compile_model, make_budgets
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.search import Search
from lazytrain.compiler.synthetic import chain
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import Decisions, Place, PlanError, Saved

MID = [(Saved.KEEP, Place.NONE), (Saved.HOST, Place.NONE), (Saved.RECOMPUTE, Place.GPU), (Saved.RECOMPUTE, Place.HOST)]
FIRST = [(Saved.KEEP, Place.NONE), (Saved.HOST, Place.NONE), (Saved.RECOMPUTE, Place.HOST)]
LAST = [(Saved.KEEP, Place.NONE), (Saved.RECOMPUTE, Place.GPU)]


def _compiler(g, budget_frac: float, mb: int, M: int, hw="rtx4090") -> Compiler:
    """Budget as a fraction of keep-all's peak, so every case has a real trade-off."""
    prof = get_profile(hw)
    big = Compiler(g, prof, {"gpu_bytes": 10**15, "host_bytes": 10**15, "nvme_bytes": 0},
                   param_dtype="bfloat16", optimizer="hybrid8bit", clip=True)
    L = g.n_blocks
    keep_all = big.build(Decisions(policy="keep-all", micro_batch=mb, n_micro=M, boundary=(Place.NONE,) * L,
                                   saved=(Saved.KEEP,) * L), mb * M)
    budget = int(keep_all.predicted["peak_gpu_bytes"] * budget_frac)
    return Compiler(g, prof, {"gpu_bytes": budget, "host_bytes": 10**15, "nvme_bytes": 0},
                    param_dtype="bfloat16", optimizer="hybrid8bit", clip=True)


def _brute_force(comp: Compiler, mb: int, M: int):
    best = None
    L = comp.graph.n_blocks
    for combo in itertools.product(FIRST, *([MID] * (L - 2)), LAST):
        d = Decisions(policy="brute-force", micro_batch=mb, n_micro=M, saved=tuple(c[0] for c in combo),
                      boundary=tuple(c[1] for c in combo))
        try:
            p = comp.build(d, mb * M)
        except PlanError:
            continue
        if best is None or p.predicted["step_time_s"] < best.predicted["step_time_s"]:
            best = p
    return best


CASES = [(3, 1, 0.5), (3, 2, 0.5), (3, 8, 0.6), (4, 4, 0.4), (4, 4, 0.6), (4, 6, 0.8), (4, 5, 0.7), (4, 3, 0.6),
         (4, 1, 0.4), (4, 10, 0.8)]      # 4-10-0.8: the head's forward window carrying block L-2's load


@pytest.mark.parametrize("n_layers, seed, frac", CASES)
def test_milp_equals_brute_force_on_small_chains(n_layers, seed, frac):
    g = chain(n_layers, seed=seed, hidden=1024, seq_len=1024, layer_params=100_000_000, saved_per_token=200_000,
              vocab=32000)
    comp = _compiler(g, frac, mb=2, M=4)
    bf = _brute_force(comp, 2, 4)
    assert bf is not None
    milp = Search(comp).best("milp", 8, micro_batch=2)
    assert milp.predicted["step_time_s"] == pytest.approx(bf.predicted["step_time_s"], rel=1e-9)


@pytest.mark.slow
def test_milp_equals_brute_force_on_eight_blocks():
    g = chain(6, seed=11, hidden=1024, seq_len=1024, layer_params=100_000_000, saved_per_token=200_000, vocab=32000)
    comp = _compiler(g, 0.5, mb=2, M=2)
    bf = _brute_force(comp, 2, 2)
    milp = Search(comp).best("milp", 4, micro_batch=2)
    assert milp.predicted["step_time_s"] == pytest.approx(bf.predicted["step_time_s"], rel=1e-9)


@cache
def graph(name):
    return trace(build_model(name), seq_len=1024)


MODELS, BUDGETS, BATCHES = ("qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "llama3-8b"), (24, 48, 80), (8, 32, 72)
#: each model at every GPU budget once and at every batch once (model m takes batch ``(j + SHIFT[m]) % 3`` at
#: budget j: a row of a Latin square), and the first three models between them at all nine (budget, batch) pairs:
#: 12 of the 36 cases of the whole product, which took 150 s on a 2-core machine, mostly in solves.  The other 24
#: checked the same two properties at other combinations; "never worse than a heuristic" is also checked over
#: 100 random compiles (``test_compile_stress.py``).  Among the 12 (on the 2-core machine): a heuristic's plan
#: kept (qwen2.5-3b, 48 GiB, batch 8: keep-all), a solve stopped by its time (qwen2.5-7b, 48 GiB, 32) and a batch
#: only megatrain fits among the heuristics (qwen2.5-14b, 24 GiB, 32)
SHIFT = {"qwen2.5-3b": 2, "qwen2.5-7b": 0, "qwen2.5-14b": 1, "llama3-8b": 2}
GRID = [(m, gb, BATCHES[(j + SHIFT[m]) % 3]) for m in MODELS for j, gb in enumerate(BUDGETS)]


def _plans(model, gb, batch):
    """Every policy's best plan from one Compiler (the MILP's heuristic warm starts are shared)."""
    hw = get_profile("h200")
    comp = Compiler(graph(model), hw, make_budgets(hw, f"{gb}GiB", "1TiB"), param_dtype="bfloat16",
                    optimizer="hybrid8bit", clip=True)
    return {pol: Search(comp).best(pol, batch) for pol in ("megatrain", "recompute-all", "keep-all", "milp")}


@pytest.mark.slow
@pytest.mark.parametrize("model, gb, batch", GRID)
def test_milp_never_worse_than_a_heuristic_and_agrees_with_the_simulator(model, gb, batch):
    plans = _plans(model, gb, batch)
    milp = plans.pop("milp")
    feasible = {k: p for k, p in plans.items() if p is not None}
    if not feasible:
        return        # nothing to compare with (then the MILP may still find a plan)
    assert milp is not None
    for name, p in feasible.items():
        assert milp.predicted["step_time_s"] <= p.predicted["step_time_s"] * (1 + 1e-9), name
    if not milp.decisions.notes.get("milp_fallback"):
        obj = milp.solver.objective
        assert abs(milp.predicted["step_time_s"] - obj) <= 0.02 * obj


def test_objective_agrees_with_simulation_on_a_real_model():
    plan = compile_model(graph("qwen2.5-3b"), batch_size=32, gpu_memory="24GiB")
    assert plan.decisions.policy == "milp" and plan.solver.status in ("optimal", "feasible")
    assert plan.solver.gap is not None and plan.solver.gap <= 0.01
    assert plan.predicted["step_time_s"] == pytest.approx(plan.solver.objective, rel=0.02)
    assert plan.predicted["step_time_s"] < plan.predicted["megatrain_step_time_s"]


def test_72b_compiles_within_20_seconds():
    """The search, the MILP solves, the resident choice and the megatrain baseline of the largest preset in
    20 s.  The trace (~4 s, the same for every size) is done first: under ``pytest -n 2`` another worker
    shares the two cores, and the whole compile, trace included, is measured alone by
    ``benchmarks/compile_times.py``.  Counted in CPU seconds, the compile's and its solver's, as the search's
    deadline counts them: on a machine other work shares, wall time says how busy the machine is."""
    from lazytrain.compiler.deadline import compile_cpu_seconds
    g = trace(build_model("qwen2.5-72b"), seq_len=1024)
    t = compile_cpu_seconds()
    plan = compile_model(g, batch_size=72, gpu_memory="80GiB", host_memory="1TiB")
    assert compile_cpu_seconds() - t <= 20
    assert plan.graph.n_blocks == 82 and plan.solver is not None


def test_cost_graph_has_boundaries_segments_windows_and_mandatory_traffic():
    from lazytrain.compiler.cost import CostModel
    from lazytrain.compiler.costgraph import build_cost_graph, window_of
    g = chain(5, seed=3)
    cost = CostModel(g, get_profile("h200"), micro_batch=2)
    G = build_cost_graph(cost)
    L = g.n_blocks
    assert all(G.has_node(("boundary", i)) for i in range(L + 1))
    assert len([n for n in G if n[0] == "window"]) == 2 * L + 1
    # a segment's recompute time is the sum of its blocks' forward times
    seg = G.edges[("boundary", 1), ("boundary", 4)]
    assert seg["recompute_s"] == pytest.approx(sum(cost.fwd_s(j) for j in (1, 2, 3)))
    # mandatory traffic: F_j prefetches block j+1's parameters, B_j drains block j+1's gradients
    assert G.nodes[("window", window_of("F", 2, L))]["h2d_s"] == pytest.approx(cost.load_s(3))
    assert G.nodes[("window", window_of("B", 2, L))]["d2h_s"] == pytest.approx(cost.grad_offload_s(3))
    assert G.nodes[("window", 2 * L)]["kind"] == "X"


def test_a_tiny_deadline_returns_the_best_plan_so_far_and_says_so():
    """The search's deadline bounds it whole: none left, no solve starts, and the best heuristic plan comes
    back with ``out_of_time`` in its solver stats (kept through the plan file) and one warning."""
    from lazytrain.ir import Plan
    g = trace(build_model("tiny"), seq_len=64)
    with pytest.warns(UserWarning, match="search deadline ran out"):
        plan = compile_model(g, batch_size=8, hardware="cpu", gpu_memory="2GiB", deadline=1e-6)
    assert plan.solver.out_of_time and plan.decisions.policy != "milp" and "milp_fallback" in plan.decisions.notes
    assert Plan.from_json(plan.to_json()).solver.out_of_time
    roomy = compile_model(g, batch_size=8, hardware="cpu", gpu_memory="2GiB", deadline=60.0)
    assert not roomy.solver.out_of_time and roomy.decisions.policy == "milp"
    assert roomy.predicted["step_time_s"] <= plan.predicted["step_time_s"]
    with pytest.raises(ValueError, match="deadline must be a positive number of seconds"):
        compile_model(g, batch_size=8, hardware="cpu", gpu_memory="2GiB", deadline=0)


def test_a_peak_under_a_gradient_drain_is_answered_by_the_drain_rows(monkeypatch):
    """A 10-block chain whose first MILP solution peaks over budget in time order while a block's gradients
    drain: one re-solve with the drain rows (``MilpOptions.drain_under_reloads``) gives a plan in budget, where
    no-good cuts and tightenings took 19 solves to the same step time."""
    import lazytrain.compiler.search as search
    asked = []
    real = search.solve

    def spy(coef, opts, **kw):
        asked.append(opts.drain_under_reloads)
        return real(coef, opts, **kw)
    monkeypatch.setattr(search, "solve", spy)
    g = chain(10, seed=5, hidden=1024, seq_len=1024, layer_params=100_000_000, saved_per_token=200_000, vocab=32000)
    comp = _compiler(g, 0.3, mb=2, M=8)
    plan = Search(comp).best("milp", 16, micro_batch=2)
    assert asked == [False, True]
    assert plan.decisions.policy == "milp" and plan.predicted["peak_gpu_bytes"] <= comp.budgets.gpu_bytes


def test_a_tightening_that_does_not_lower_the_peak_grows_the_next_one():
    """The rows' budget steps down by the excess, and by twice the last step where that last step lowered the
    excess by less than half its size (a peak the rows do not reach there: stepping by the excess alone creeps)."""
    from lazytrain.compiler.search import tightening
    GiB = 2**30
    first = tightening(3 * GiB, (0, 0))
    assert first == (int(3 * GiB * 1.05) + 1, 3 * GiB)
    worked = tightening(GiB // 10, first)                  # the excess fell by far more than half the step
    assert worked[0] == int(GiB // 10 * 1.05) + 1
    stalled = tightening(GiB // 10, worked)                # the same excess again: the step doubles
    assert stalled[0] == 2 * worked[0] and tightening(GiB // 10, stalled)[0] == 4 * worked[0]
