"""Predicted step time of the MILP against the heuristics, for the issue's grid.

    python benchmarks/milp_table.py [-o benchmarks/results/milp_table.md]

Compiles on the built-in h200 profile (no GPU needed) with host memory 1 TiB so that the GPU
budget is what binds.  Prints a markdown table and writes it (with the command and date) to -o.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

from lazytrain.compiler.api import compile_model
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import PlanError

#: the grid: GPU budgets (GiB) and batches per model; each cell compiles every (policy, resident) below
MODELS, GPU_GIB, BATCHES = ("qwen2.5-7b", "qwen2.5-32b"), (24, 80), (32, 72)
POLICIES = (("milp", "none"), ("megatrain", "none"), ("recompute-all", "none"), ("default", "auto"))


def row(graph, model: str, gb: int, batch: int) -> list:
    """One model / budget / batch: the MILP with every block streamed (the solver's own quality: its
    gap and time), the heuristics, and the default compile (the MILP with resident blocks when the
    search finds them worth their memory)."""
    out = {}
    for pol, res in POLICIES:
        t = time.perf_counter()
        try:
            out[pol] = (compile_model(graph, batch_size=batch, gpu_memory=f"{gb}GiB", host_memory="1TiB",
                                      policy="milp" if pol == "default" else pol, resident=res),
                        time.perf_counter() - t)
        except PlanError:
            out[pol] = (None, time.perf_counter() - t)

    def step(pol):
        p = out[pol][0]
        if not p:
            return "does not fit"
        res = len(p.decisions.resident_blocks)
        return f"{p.predicted['step_time_s']:.3f} (mb {p.micro_batch}{f', {res} resident' if res else ''})"
    milp = out["milp"][0]
    mega = out["megatrain"][0]
    gain = f"{mega.predicted['step_time_s'] / milp.predicted['step_time_s']:.3f}x" if milp and mega else ""
    st = milp.solver if milp else None
    return [model, f"{gb} GiB", batch, step("milp"), step("megatrain"), step("recompute-all"), gain,
            f"{st.seconds:.2f}" if st else "", f"{100 * st.gap:.2f}%" if st and st.gap is not None else "",
            f"{out['milp'][1]:.1f}", step("default"), f"{out['default'][1]:.1f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    from tabulate import tabulate
    rows = []
    for model in a.models.split(","):
        g = trace(build_model(model), seq_len=1024)
        for gb in GPU_GIB:
            for batch in BATCHES:
                rows.append(row(g, model, gb, batch))
                print(rows[-1], flush=True)
    table = tabulate(rows, headers=["model", "GPU", "batch", "MILP step s", "megatrain step s", "recompute-all step s",
                                    "MILP gain", "solve s", "gap", "compile s", "default compile step s",
                                    "default compile s"], tablefmt="github")
    print(table)
    if a.output:
        with open(a.output, "w") as f:
            f.write(f"# Predicted step time: MILP vs heuristics (h200 profile, seq 1024)\n\n"
                    f"`python benchmarks/milp_table.py -o {a.output}` on {datetime.date.today()}, "
                    f"{platform.processor() or platform.machine()} ({__import__('os').cpu_count()} cores); "
                    f"solve s is the last MILP solve, compile s the whole compile (trace excluded); the MILP "
                    f"columns stream every block (`resident=\"none\"`), the default compile may keep the first "
                    f"blocks resident on the GPU (`resident=\"auto\"`).\n\n{table}\n")


if __name__ == "__main__":
    main()
