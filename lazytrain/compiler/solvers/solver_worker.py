"""The solver process: reads linear models (``lp.LinearModel.to_json``) as JSON lines on stdin,
solves each with python-mip on the named solver, and answers one JSON line per model.

It runs as a script (``python solver_worker.py``), imports only the standard library and mip, and
owns the solver's native library, so a crash in it ends this process and not the compiler's
(``isolated.py`` notices and falls back).  The native libraries print to file descriptor 1 (HiGHS
writes its banner there), so the answers go to a duplicate of the original stdout and fd 1 is
pointed at stderr.

The time limit counts the CPU time this process spends on the request (model build included), not wall time:
on a machine other work shares, a solve then gets the same work done whatever the load, and the same inputs
give the same plan.  HiGHS is stopped by its MIP interrupt callback once the CPU time is spent (its own limit
is wall time: it stays as the backstop ``wall_limit``); CBC counts CPU time itself.

Request::   {"solver": "highs"|"cbc", "model": {...}, "time_limit": cpu s, "wall_limit": s, "gap": rel,
             "cuts": n|null}
Answer::    {"status": "optimal"|"feasible"|"infeasible"|"no_solution"|..., "objective": f|null,
             "gap": f|null, "x": [..]|null, "seconds": s, "cpu_s": s, "solver": name}
"""

from __future__ import annotations

import json
import os
import sys
import time


def _stop_highs_on_cpu(m, cpu_end: float, cpu_limit: float, wall_limit: float) -> object:
    """Stop ``m``'s HiGHS run once this process's CPU time reaches ``cpu_end``.  HiGHS calls its MIP interrupt
    callback where it checks its own limits, which it does not do inside an LP solve or a sub-MIP heuristic (a
    3B compiled-blocks model ran 1.5 s of CPU between two calls, past a 2 s limit by 60%); its own time limit,
    which counts wall time, is checked there too.  So each call interrupts the run when the CPU time is spent,
    and otherwise moves HiGHS's wall limit to when the CPU time left will be spent at the rate this run has
    had so far (wall seconds per CPU second, at most ``wall_limit / cpu_limit``), never past ``wall_limit``.
    An interrupted run answers as a timed-out one (python-mip does not know HiGHS's interrupt status).
    Returns the callback, which must outlive the run."""
    from mip.highs import ffi
    s = m.solver
    lib = s._lib
    cpu0, wall0 = time.process_time(), time.perf_counter()
    most = max(1.0, wall_limit / max(cpu_limit, 1e-9))

    @ffi.callback("void(int, const char*, const HighsCallbackDataOut*, HighsCallbackDataIn*, void*)")
    def on_check(kind, message, data_out, data_in, user):
        cpu = time.process_time()
        if cpu >= cpu_end:
            data_in.user_interrupt = 1
            return
        wall_per_cpu = min(most, max(1.0, (time.perf_counter() - wall0) / max(cpu - cpu0, 1e-3)))
        run = lib.Highs_getRunTime(s._model)
        lib.Highs_setDoubleOptionValue(s._model, b"time_limit",
                                       min(wall_limit, run + (cpu_end - cpu) * wall_per_cpu))

    lib.Highs_setCallback(s._model, on_check, ffi.NULL)
    lib.Highs_startCallback(s._model, lib.kHighsCallbackMipInterrupt)
    status = s.get_status

    def get_status():
        if lib.Highs_getModelStatus(s._model) == lib.kHighsModelStatusInterrupt:
            import mip
            return mip.OptimizationStatus.FEASIBLE if s._has_primal_solution() else \
                mip.OptimizationStatus.NO_SOLUTION_FOUND
        return status()

    s.get_status = get_status
    return on_check


def solve(req: dict) -> dict:
    import mip  # after main() points fd 1 at stderr: its native libraries print as they load

    t0, c0 = time.perf_counter(), time.process_time()
    cpu_limit = float(req["time_limit"])
    wall_limit = float(req.get("wall_limit") or cpu_limit)
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
    if name == mip.HIGHS:
        keep = _stop_highs_on_cpu(m, c0 + cpu_limit, cpu_limit, wall_limit)  # noqa: F841 - the callback must live through the run
        limit = wall_limit
    else:
        # CBC counts CPU time when told (its integer switch for it has no effect); the wall backstop is the
        # caller's wait for the answer
        from mip.cbc import cbc_set_parameter
        cbc_set_parameter(m.solver, "timeMode", "cpu")
        limit = max(0.0, cpu_limit - (time.process_time() - c0))
    status = m.optimize(max_seconds=limit)
    ok = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
    return {"status": {"NO_SOLUTION_FOUND": "no_solution"}.get(status.name, status.name.lower()),
            "objective": float(m.objective_value) if ok else None, "gap": float(m.gap) if ok else None,
            "x": [float(c.x) if c.x is not None else None for c in cols] if ok else None,
            "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "solver": req["solver"]}


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
