"""The solver process: reads linear models (``lp.LinearModel.to_json``) as JSON lines on stdin,
solves each with python-mip on the named solver, and answers one JSON line per model.

It runs as a script (``python solver_worker.py``), imports only the standard library and mip, and
owns the solver's native library, so a crash in it ends this process and not the compiler's
(``isolated.py`` notices and falls back).  The native libraries print to file descriptor 1 (HiGHS
writes its banner there), so the answers go to a duplicate of the original stdout and fd 1 is
pointed at stderr.

Request::   {"solver": "highs"|"cbc", "model": {...}, "time_limit": s, "gap": rel, "cuts": n|null}
Answer::    {"status": "optimal"|"feasible"|"infeasible"|"no_solution"|..., "objective": f|null,
             "gap": f|null, "x": [..]|null, "seconds": s, "solver": name}
"""

from __future__ import annotations

import json
import os
import sys
import time


def solve(req: dict) -> dict:
    import mip  # after main() points fd 1 at stderr: its native libraries print as they load

    t0 = time.perf_counter()
    name = {"highs": mip.HIGHS, "cbc": mip.CBC}[req["solver"]]
    data = req["model"]
    m = mip.Model(name="lazytrain", sense=mip.MINIMIZE, solver_name=name)
    m.verbose = 0
    m.threads = 1            # one thread: reproducible plans; CBC's parallel search is its least stable part
    if req.get("cuts") is not None and name == mip.CBC:
        m.cuts = int(req["cuts"])
    cols = [m.add_var(n, lb=lb, ub=ub, var_type=mip.INTEGER if integer else mip.CONTINUOUS)
            for n, lb, ub, integer in data["vars"]]
    for rname, idx, coef, sense, rhs in data["rows"]:
        lhs = mip.xsum(c * cols[i] for i, c in zip(idx, coef))
        row = lhs <= rhs if sense == "<=" else lhs >= rhs if sense == ">=" else lhs == rhs
        m.add_constr(row, rname)
    idx, coef, const = data["objective"]
    m.objective = mip.xsum(c * cols[i] for i, c in zip(idx, coef)) + const
    if data.get("start"):
        m.start = [(cols[i], v) for i, v in data["start"]]
    m.max_mip_gap = float(req.get("gap", 1e-4))
    status = m.optimize(max_seconds=float(req["time_limit"]))
    ok = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
    return {"status": {"NO_SOLUTION_FOUND": "no_solution"}.get(status.name, status.name.lower()),
            "objective": float(m.objective_value) if ok else None, "gap": float(m.gap) if ok else None,
            "x": [float(c.x) if c.x is not None else None for c in cols] if ok else None,
            "seconds": time.perf_counter() - t0, "solver": req["solver"]}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:    # now, not at the first request: the caller starts this process early (``isolated.prestart``), so
        import mip  # noqa: F401 - mip's ~0.2 s import overlaps the caller's trace on another core
    except ImportError:
        pass        # answered at the first request, as an error naming the missing library
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = solve(json.loads(line))
        except Exception as e:  # noqa: BLE001 - any error is an answer, the caller decides
            out = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(out) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
