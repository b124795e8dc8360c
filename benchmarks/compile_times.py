"""Wall time of the default compile for every preset at batch 8, 32 and 72 and GPU budgets 24, 48 and
80 GiB (h200 profile, seq 1024, host 1 TiB so the GPU budget binds), with the plan it returns.

    python benchmarks/compile_times.py [-o benchmarks/results/compile_times] [--models a,b]
    python benchmarks/compile_times.py --rows qwen3-32b:80:8,llama3-8b:48:8 --repeat 3 [-o NAME]
    python benchmarks/compile_times.py --cold [--models a,b] [-o NAME]     (every compile a model's first)

Each compile runs in a fresh process (``lazytrain compile``'s path: the preset is traced, then the
search, the resident choice and the megatrain baseline), so the wall time is what a user waits, trace
included and reported apart; ``out_of_time``: the search's deadline (``compiler/search.py``) ran out, on the
clock ``deadline_clock`` names ("cpu": the compile's CPU time; "wall": the backstop on a starved machine).
The contract: <= 20 s for every preset, <= 5 s up to 8B parameters.

The trace cache (``frontend/trace_cache.py``) is a fresh folder unless ``--trace-cache`` names one, so
each model's first compile traces it and the other eight read the trace (``trace_cached``).  Beside the
wall times, CPU seconds: ``cpu_s`` of the whole process (start-up and imports included) and
``compile_cpu_s`` of ``compile_model`` alone, solver worker included; on a machine other work shares,
CPU time moves far less than wall time (``load``: the 1-minute load average when the compile ended).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

PRESETS = ("tiny", "gpt2", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama3-8b", "qwen3-8b",
           "qwen2.5-14b", "qwen2.5-32b", "qwen3-32b", "llama3-70b", "qwen2.5-72b")

ONE = """
import json, resource, sys, time, warnings
t0 = time.perf_counter()
from lazytrain.compiler.api import compile_model
from lazytrain.ir import PlanError
model, batch, gb = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = {}
c0 = time.process_time()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        p = compile_model(model, batch_size=batch, seq_len=1024, gpu_memory=gb, host_memory="1TiB")
        hist = {h["pass"]: h for h in p.history}
        out = {"step_s": p.predicted["step_time_s"], "micro_batch": p.micro_batch,
               "resident": len(p.decisions.resident_blocks), "policy": p.decisions.policy,
               "params_b": p.graph.total_params / 1e9, "trace_s": hist.get("trace", {}).get("seconds", 0.0),
               "trace_cached": hist.get("trace", {}).get("cached", False),
               "seed": hist.get("trace", {}).get("seed", ""), "compile_s": hist["total"]["seconds"],
               "megatrain_s": p.predicted.get("megatrain_step_time_s"),
               "solver": p.solver.solver if p.solver else None, "gap": p.solver.gap if p.solver else None,
               "out_of_time": bool(getattr(p.solver, "out_of_time", False)),
               "deadline_clock": getattr(p.solver, "deadline_clock", "")}
    except PlanError as e:
        out = {"error": str(e)[:100]}
try:      # the solver workers exit here, so their CPU time is counted as this process's children's
    from lazytrain.compiler.solvers.isolated import shutdown
    shutdown()
except ImportError:
    pass
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
out["compile_cpu_s"] = time.process_time() - c0 + ru.ru_utime + ru.ru_stime
out["warnings"] = [str(w.message)[:120] for w in caught]
out["process_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def _children_cpu() -> float:
    """CPU seconds of the finished child processes (the compile's and its solver worker's, user + system):
    less sensitive to other work on the machine than the wall time."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def grid(models: list[str]) -> list[tuple[str, int, int]]:
    """(model, GPU GiB, batch) of every compile of the grid."""
    return [(model, gb, batch) for model in models for gb in (24, 48, 80) for batch in (8, 32, 72)]


def run(cases: list[tuple[str, int, int]], cache: str | None, repeat: int = 1) -> list[dict]:
    """Every compile of ``cases``, one process each, with the trace cache in ``cache`` (None: an empty one for
    each compile, every one a model's first); ``repeat`` rounds over all of them (a row's later rounds read its
    trace from the cache)."""
    rows = []
    for round_ in range(repeat):
        for model, gb, batch in cases:
            env = {**os.environ, "LAZYTRAIN_TRACE_CACHE": cache or tempfile.mkdtemp(prefix="lazytrain-traces-")}
            t, cpu = time.perf_counter(), _children_cpu()
            r = subprocess.run([sys.executable, "-c", ONE, model, str(batch), f"{gb}GiB"], capture_output=True,
                               text=True, env=env)
            wall, cpu = time.perf_counter() - t, _children_cpu() - cpu
            try:
                row = json.loads(r.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row = {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:100]}
            row.update(model=model, gpu_gb=gb, batch=batch, wall_s=wall, cpu_s=cpu, load=os.getloadavg()[0])
            if repeat > 1:
                row["round"] = round_
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def spread(rows: list[dict]) -> str:
    """Lines on how far the predicted step of the same compile moved between rounds (``--repeat``)."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("step_s"):
            by.setdefault((r["model"], r["gpu_gb"], r["batch"]), []).append(r)
    lines = []
    for (model, gb, batch), rs in by.items():
        if len(rs) < 2:
            continue
        steps = [r["step_s"] for r in rs]
        lines.append(f"- {model} {gb} GiB b{batch}: step {', '.join(f'{s:.3f}' for s in steps)} s over {len(rs)} "
                     f"rounds ({100 * (max(steps) / min(steps) - 1):.1f}% apart), micro-batch "
                     f"{', '.join(str(r['micro_batch']) for r in rs)}, out of time "
                     f"{sum(bool(r.get('out_of_time')) for r in rs)} of {len(rs)}")
    return "\n".join(lines)


def _over(rows: list[dict], key: str) -> str:
    """How many compiles of up to 8B miss 5 s and how many of all miss 20 s, by ``key``."""
    ok = [r for r in rows if key in r]
    small = [r for r in ok if r["params_b"] <= 8.1]
    return (f"{sum(r[key] > 5 for r in small)} of {len(small)} up to 8B over 5 s, "
            f"{sum(r[key] > 20 for r in ok)} of {len(ok)} over 20 s")


def report(rows: list[dict], base: list[dict] | None) -> tuple[str, str]:
    """(summary lines, table); with ``base`` (an earlier run's rows) its step and CPU time beside each row."""
    from tabulate import tabulate
    cols = ["model", "gpu_gb", "batch", "wall_s", "cpu_s", "trace_s", "trace_cached", "seed", "compile_s",
            "compile_cpu_s", "load", "step_s", "megatrain_s", "micro_batch", "resident", "policy", "solver", "gap",
            "out_of_time", "deadline_clock", "error"]
    if base is not None:
        before = {(r["model"], r["gpu_gb"], r["batch"]): r for r in base}
        for r in rows:
            b = before.get((r["model"], r["gpu_gb"], r["batch"]), {})
            r["base_step_s"], r["base_compile_cpu_s"] = b.get("step_s"), b.get("compile_cpu_s")
            if r.get("step_s") and b.get("step_s"):
                r["step_change_pct"] = 100 * (r["step_s"] / b["step_s"] - 1)
        cols[cols.index("step_s") + 1:cols.index("step_s") + 1] = ["base_step_s", "step_change_pct"]
        cols[cols.index("compile_cpu_s") + 1:cols.index("compile_cpu_s") + 1] = ["base_compile_cpu_s"]
    table = tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, tablefmt="github", floatfmt=".3f")
    ok = [r for r in rows if "compile_s" in r]
    if not ok:
        return "- no plan", table
    worst = max(ok, key=lambda r: r["compile_s"])
    loads = [r["load"] for r in rows if "load" in r]
    lines = [f"- {len(rows)} compiles, {len(ok)} with a plan, the rest a budget error; compile (trace included) max "
             f"{worst['compile_s']:.1f} s ({worst['model']} {worst['gpu_gb']} GiB b{worst['batch']}); wall per "
             f"process incl. start-up and trace max {max(r['wall_s'] for r in rows):.1f} s",
             f"- by compile wall time (``compile_s``): {_over(rows, 'compile_s')}",
             f"- by compile CPU time, solver included (``compile_cpu_s``): {_over(rows, 'compile_cpu_s')}"]
    late = [f"{r['model']} {r['gpu_gb']} GiB b{r['batch']}" for r in ok if r.get("out_of_time")]
    lines.append(f"- the search's deadline ran out in {len(late)} of {len(ok)}"
                 + (f": {', '.join(late)}" if late else ""))
    if loads:
        lines.append(f"- load average during the run: {min(loads):.1f} to {max(loads):.1f}")
    if base is not None:
        ch = [r["step_change_pct"] for r in rows if "step_change_pct" in r]
        lines.append(f"- predicted step against the base run: {sum(c > 0.5 for c in ch)} of {len(ch)} rows more than "
                     f"0.5% slower, {sum(c < -0.5 for c in ch)} more than 0.5% faster (worst {max(ch):+.2f}%)")
    return "\n".join(lines), table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None, help="path stem for NAME.json and NAME.md")
    ap.add_argument("--models", default=",".join(PRESETS))
    ap.add_argument("--rows", default=None, help="MODEL:GIB:BATCH,... instead of the models' grid")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the rows: how far the same compile's plan "
                    "moves from run to run")
    ap.add_argument("--trace-cache", default=None, help="trace cache folder (default: a fresh one, so each model's "
                    "first compile traces and the others read the cache)")
    ap.add_argument("--cold", action="store_true", help="an empty trace cache for every compile: each is its "
                    "model's first, as on a fresh machine")
    ap.add_argument("--from-json", default=None, help="report a saved run (its NAME.json) instead of compiling")
    ap.add_argument("--compare", default=None, help="an earlier run's NAME.json: its step and CPU time beside each row")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        rows, date, machine = saved["rows"], saved["date"], saved["machine"]
    else:
        cases = ([(m, int(gb), int(b)) for m, gb, b in (c.split(":") for c in a.rows.split(","))] if a.rows
                 else grid(a.models.split(",")))
        rows = run(cases, None if a.cold else a.trace_cache or tempfile.mkdtemp(prefix="lazytrain-traces-"),
                   a.repeat)
        date, machine = str(datetime.date.today()), f"{platform.machine()}, {os.cpu_count()} cores"
    base = None
    if a.compare:
        with open(a.compare) as f:
            base = json.load(f)["rows"]
    text, table = report(rows, base)
    if any("round" in r for r in rows):
        text += "\n" + spread(rows)
    print(text)
    if a.output:
        cmd = "python benchmarks/compile_times.py" + "".join(
            f" {flag} {v}" for flag, v in (("--rows", a.rows), ("--repeat", a.repeat if a.repeat > 1 else None))
            if v) + (" --cold" if a.cold else "") + f" -o {a.output}"
        with open(a.output + ".json", "w") as f:
            json.dump({"command": cmd, "date": date, "machine": machine, "rows": rows}, f, indent=1)
        with open(a.output + ".md", "w") as f:
            title = "The same compiles, repeated" if a.rows else "Compile time of every preset"
            f.write(f"# {title}\n\n`{cmd}` on {date}, {machine}; h200 profile, seq 1024, "
                    f"host 1 TiB; one process per compile.\n\n{text}\n\n{table}\n")


if __name__ == "__main__":
    main()
