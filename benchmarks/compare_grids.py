"""Two runs of the compile grid (``compile_times.py``'s JSON files) side by side: the same plans, and how the compile
times compare.

    python benchmarks/compare_grids.py BASE.json [BASE2.json ...] --new NEW.json [NEW2.json ...] [-o OUT.md]

Rows are matched by (model, GPU GiB, batch).  A row's plan is the same where the predicted step, the micro-batch,
the resident blocks and the policy agree (a MILP solve under a time limit may end elsewhere between runs: such a
row is listed, not hidden).  Times: the sum and the median ratio of each row's ``compile_s`` (the compile's wall
time, trace included) and ``compile_cpu_s`` (its CPU time, the solver's included), new over base; run the two
grids interleaved on one machine (``compile_times.py --models M`` for each tree in turn) so load falls on both.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PLAN_KEYS = ("step_s", "micro_batch", "resident", "policy", "error")


def _rows(paths: list[Path]) -> dict[tuple, dict]:
    out = {}
    for p in paths:
        for r in json.loads(p.read_text())["rows"]:
            out[(r["model"], r["gpu_gb"], r["batch"])] = r
    return out


def compare(base: dict[tuple, dict], new: dict[tuple, dict]) -> tuple[list[str], list[list]]:
    """(summary lines, table rows) of the rows both runs have."""
    keys = [k for k in base if k in new]
    table, differ, ratios = [], [], {"compile_s": [], "compile_cpu_s": []}
    for k in keys:
        b, n = base[k], new[k]
        same = all(b.get(f) == n.get(f) for f in PLAN_KEYS)
        if not same:
            differ.append(k)
        for f in ratios:
            if b.get(f) and n.get(f):
                ratios[f].append(n[f] / b[f])
        table.append([*k, b.get("step_s") or b.get("error", "")[:40], n.get("step_s") or n.get("error", "")[:40],
                      "same" if same else "differs", b.get("compile_s"), n.get("compile_s"), b.get("compile_cpu_s"),
                      n.get("compile_cpu_s")])
    lines = [f"- {len(keys)} compiles in both runs; plans (step, micro-batch, resident blocks, policy, error) the same "
             f"in {len(keys) - len(differ)}" + (f"; differ: {', '.join(f'{m} {g} GiB b{b}' for m, g, b in differ)}"
                                                 if differ else "")]
    for f, rs in ratios.items():
        tb = sum(base[k][f] for k in keys if base[k].get(f) and new[k].get(f))
        tn = sum(new[k][f] for k in keys if base[k].get(f) and new[k].get(f))
        lines.append(f"- `{f}`: {tb:.1f} s in all before, {tn:.1f} s after ({100 * (tn / tb - 1):+.1f}%); per row new/"
                     f"base median {statistics.median(rs):.3f}, max {max(rs):.2f}")
    return lines, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", nargs="+", type=Path)
    ap.add_argument("--new", nargs="+", type=Path, required=True)
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the report here (markdown)")
    a = ap.parse_args()
    from tabulate import tabulate
    lines, table = compare(_rows(a.base), _rows(a.new))
    text = "\n".join(lines) + "\n\n" + tabulate(
        table, headers=["model", "gpu_gb", "batch", "step before", "step after", "plan", "compile_s before",
                        "compile_s after", "cpu_s before", "cpu_s after"], tablefmt="github", floatfmt=".3f") + "\n"
    print(text)
    if a.output:
        a.output.write_text(text)


if __name__ == "__main__":
    main()
