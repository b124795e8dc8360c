"""Wall time of the default compile for every preset at batch 8, 32 and 72 and GPU budgets 24, 48 and
80 GiB (h200 profile, seq 1024, host 1 TiB so the GPU budget binds), with the plan it returns.

    python benchmarks/compile_times.py [-o benchmarks/results/compile_times] [--models a,b]

Each compile runs in a fresh process (``lazytrain compile``'s path: the preset is traced, then the
search, the resident choice and the megatrain baseline), so the wall time is what a user waits, trace
included and reported apart.  The contract: <= 20 s for every preset, <= 5 s up to 8B parameters.

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
               "trace_cached": hist.get("trace", {}).get("cached", False), "compile_s": hist["total"]["seconds"],
               "megatrain_s": p.predicted.get("megatrain_step_time_s"),
               "solver": p.solver.solver if p.solver else None, "gap": p.solver.gap if p.solver else None}
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None, help="path stem for NAME.json and NAME.md")
    ap.add_argument("--models", default=",".join(PRESETS))
    ap.add_argument("--trace-cache", default=None, help="trace cache folder (default: a fresh one, so each model's "
                    "first compile traces and the others read the cache)")
    a = ap.parse_args()
    cache = a.trace_cache or tempfile.mkdtemp(prefix="lazytrain-traces-")
    env = {**os.environ, "LAZYTRAIN_TRACE_CACHE": cache}
    rows = []
    for model in a.models.split(","):
        for gb in (24, 48, 80):
            for batch in (8, 32, 72):
                t, cpu = time.perf_counter(), _children_cpu()
                r = subprocess.run([sys.executable, "-c", ONE, model, str(batch), f"{gb}GiB"], capture_output=True,
                                   text=True, env=env)
                wall, cpu = time.perf_counter() - t, _children_cpu() - cpu
                try:
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    row = {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:100]}
                row.update(model=model, gpu_gb=gb, batch=batch, wall_s=wall, cpu_s=cpu, load=os.getloadavg()[0])
                rows.append(row)
                print(json.dumps(row), flush=True)
    from tabulate import tabulate
    cols = ["model", "gpu_gb", "batch", "wall_s", "cpu_s", "trace_s", "trace_cached", "compile_s", "compile_cpu_s",
            "load", "step_s", "megatrain_s", "micro_batch", "resident", "policy", "solver", "gap", "error"]
    table = tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, tablefmt="github", floatfmt=".3f")
    ok = [r for r in rows if "compile_s" in r]
    small = [r for r in ok if r["params_b"] <= 8.1]
    worst = max(ok, key=lambda r: r["compile_s"]) if ok else None
    text = (f"- {len(rows)} compiles, {len(ok)} with a plan, the rest a budget error; compile (trace included) max "
            f"{worst['compile_s']:.1f} s ({worst['model']} {worst['gpu_gb']} GiB b{worst['batch']}); up to 8B: max "
            f"{max(r['compile_s'] for r in small):.1f} s; wall per process incl. start-up and trace max "
            f"{max(r['wall_s'] for r in rows):.1f} s") if ok else "- no plan"
    print(text)
    if a.output:
        cmd = f"python benchmarks/compile_times.py -o {a.output}"
        with open(a.output + ".json", "w") as f:
            json.dump({"command": cmd, "date": str(datetime.date.today()),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores", "rows": rows}, f, indent=1)
        with open(a.output + ".md", "w") as f:
            f.write(f"# Compile time of every preset\n\n`{cmd}` on {datetime.date.today()}, {platform.machine()} "
                    f"({os.cpu_count()} cores); h200 profile, seq 1024, host 1 TiB; one process per compile.\n\n"
                    f"{text}\n\n{table}\n")


if __name__ == "__main__":
    main()
