"""CBC against HiGHS on the MILP as the compiler poses it: crashes, wall time, gap, plan quality.

    python benchmarks/solver_grid.py [-o benchmarks/results/solver_grid] [--time-limit 10] [--quick]

Each case is one model / batch / GPU budget / NVMe setting (h200 profile, seq 1024, host 1 TiB) or a
random chain of the brute-force tests.  The case's model is the one the compiler's first MILP solve
poses (at the best heuristic's micro-batch, warm-started from it, resident blocks chosen by the
solver); it is solved by each solver in its own child process (``solvers/isolated.py``, no fallback),
and each solution is lowered and simulated, so "plan s" is the predicted step time of the plan that
solver leads to.  Writes ``NAME.json`` (every row) and ``NAME.md`` (the table and a summary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

from lazytrain.compiler.api import Compiler, make_budgets
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.search import Search
from lazytrain.compiler.solvers import isolated
from lazytrain.compiler.solvers.milp import CBC_CUTS, GAP_TARGET, SHORT_CHAIN, MilpOptions, coefficients, decode
from lazytrain.compiler.solvers.milp import build_model as milp_model
from lazytrain.compiler.synthetic import chain
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import PlanError

SOLVERS = ("highs", "cbc")
PRESETS = ("qwen2.5-0.5b", "qwen2.5-3b", "qwen2.5-7b", "llama3-8b", "qwen2.5-14b", "qwen2.5-32b", "llama3-70b",
           "qwen2.5-72b")


def preset_cases(quick: bool) -> list[dict]:
    cases = []
    for model in PRESETS[:3] if quick else PRESETS:
        for batch in (8, 32, 72):
            for gb in (24, 80):
                cases.append({"model": model, "batch": batch, "gpu_gb": gb, "nvme": False})
            # NVMe on where host memory is what limits: a 256 GiB host
            cases.append({"model": model, "batch": batch, "gpu_gb": 24, "nvme": True})
    return cases


def chain_cases(quick: bool) -> list[dict]:
    return [{"chain": (n, seed), "batch": 8, "gpu_gb": None, "nvme": False}
            for n, seed in ([(4, 3)] if quick else [(3, 1), (3, 8), (4, 4), (4, 6), (4, 10), (6, 11), (8, 2), (12, 5),
                                                    (16, 7), (24, 9)])]


def compiler_for(case: dict, graphs: dict) -> Compiler:
    hw = get_profile("h200")
    if "chain" in case:
        n, seed = case["chain"]
        g = chain(n, seed=seed, hidden=1024, seq_len=1024, layer_params=100_000_000, saved_per_token=200_000,
                  vocab=32000)
        # half of keep-all's peak at micro-batch 2: a real trade-off between keeping and recomputing
        big = Compiler(g, hw, make_budgets(hw, "10000GiB", "10000GiB"), param_dtype="bfloat16",
                       optimizer="hybrid8bit", clip=True)
        peak = Search(big).best("keep-all", case["batch"], 2).predicted["peak_gpu_bytes"]
        reserve = int(1.5 * 2**30)
        budgets = make_budgets(hw, int(peak * 0.5) + reserve, "10000GiB", reserve=reserve)
        return Compiler(g, hw, budgets, param_dtype="bfloat16", optimizer="hybrid8bit", clip=True,
                        choose_resident=True)
    if case["model"] not in graphs:
        graphs[case["model"]] = trace(build_model(case["model"]), seq_len=1024)
    if case["nvme"]:
        budgets = make_budgets(hw, f"{case['gpu_gb']}GiB", "256GiB", "/nvme", "2TiB")
    else:
        budgets = make_budgets(hw, f"{case['gpu_gb']}GiB", "1TiB")
    return Compiler(graphs[case["model"]], hw, budgets, param_dtype="bfloat16", optimizer="hybrid8bit", clip=True,
                    choose_resident=True)


def run_case(case: dict, graphs: dict, time_limit: float) -> list[dict]:
    comp = compiler_for(case, graphs)
    warm = (Search(comp).heuristics(case["batch"], None) or [None])[0]
    mb = warm.micro_batch if warm else 1
    coef = coefficients(comp.cost(mb, frozenset()), comp.budgets, case["batch"] // mb,
                        comp.options["host_bytes_per_param"])
    opts = MilpOptions(clip=True, time_limit=time_limit, choose_resident=True)
    model, v = milp_model(coef, opts, warm=warm.decisions if warm else None)
    gap = GAP_TARGET if coef.L > SHORT_CHAIN else 1e-9
    rows = []
    for solver in SOLVERS:
        row = {**case, "solver": solver, "micro_batch": mb, "n_vars": model.n_vars, "n_rows": model.n_rows,
               "warm_s": warm.predicted["step_time_s"] if warm else None}
        t = time.perf_counter()
        try:
            r = isolated.solve(model, order=(solver,), time_limit=time_limit, gap=gap, cuts=CBC_CUTS)
            row.update(status=r.status, wall_s=time.perf_counter() - t, gap=r.gap, objective=r.objective)
            if r.ok:
                dec = decode(v, r.x, micro_batch=mb, n_micro=coef.M, objective_s=0.0)
                try:
                    plan = comp.build(dec, case["batch"], check_budget=False)
                    row["plan_s"] = plan.predicted["step_time_s"]
                    row["fits"] = plan.predicted["peak_gpu_bytes"] <= comp.budgets.gpu_bytes
                    row["resident"] = len(dec.resident_blocks)
                except PlanError as e:
                    row["plan_error"] = str(e)
        except isolated.SolverFailure as e:
            row.update(status="failed", wall_s=time.perf_counter() - t, failure=str(e))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    lines = []
    for s in SOLVERS:
        mine = [r for r in rows if r["solver"] == s]
        walls = sorted(r["wall_s"] for r in mine)
        failed = [r for r in mine if r["status"] == "failed"]
        gaps = [r["gap"] for r in mine if r.get("gap") is not None]
        lines.append(f"- {s}: {len(mine)} solves, {len(failed)} failed (crash / hang / invalid answer), wall "
                     f"median {walls[len(walls) // 2]:.2f} s, max {walls[-1]:.2f} s, total {sum(walls):.1f} s; "
                     f"gap max {100 * max(gaps, default=0):.2f}%")
    pairs = {}
    for r in rows:
        pairs.setdefault(json.dumps({k: r[k] for k in ("model", "chain", "batch", "gpu_gb", "nvme") if k in r}),
                         {})[r["solver"]] = r
    better = {s: 0 for s in SOLVERS}
    ties = 0
    for p in pairs.values():
        a, b = (p.get(s, {}).get("plan_s") for s in SOLVERS)
        if a is None or b is None:
            continue
        if abs(a - b) <= 1e-3 * min(a, b):
            ties += 1
        else:
            better[SOLVERS[0] if a < b else SOLVERS[1]] += 1
    lines.append(f"- plan quality (predicted step of the lowered plan, 0.1% tolerance): {ties} equal, "
                 + ", ".join(f"{s} faster in {n}" for s, n in better.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None, help="path stem for NAME.json and NAME.md")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="a few cases (a smoke run)")
    a = ap.parse_args()
    graphs: dict = {}
    rows = []
    for case in chain_cases(a.quick) + preset_cases(a.quick):
        rows.extend(run_case(case, graphs, a.time_limit))
    from tabulate import tabulate
    cols = ["model", "chain", "batch", "gpu_gb", "nvme", "solver", "micro_batch", "n_vars", "status", "wall_s", "gap",
            "plan_s", "warm_s", "resident", "failure"]
    table = tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, tablefmt="github", floatfmt=".3f")
    text = summary(rows)
    print(text)
    if a.output:
        with open(a.output + ".json", "w") as f:
            json.dump({"command": f"python benchmarks/solver_grid.py -o {a.output} --time-limit {a.time_limit}",
                       "date": str(datetime.date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                       "rows": rows}, f, indent=1)
        with open(a.output + ".md", "w") as f:
            f.write(f"# MILP solvers: HiGHS and CBC on the compiler's models\n\n`python benchmarks/solver_grid.py -o "
                    f"{a.output} --time-limit {a.time_limit}` on {datetime.date.today()}, {platform.machine()} "
                    f"({os.cpu_count()} cores), h200 profile, seq 1024.  One solve per solver per case, each in its "
                    f"own child process; plan s is the simulated step of the lowered solution, warm s the heuristic "
                    f"start's.\n\n{text}\n\n{table}\n")


if __name__ == "__main__":
    main()
