"""Are the plans of ``policy_table.py``'s and ``milp_table.py``'s rows the same as a saved baseline?

    python benchmarks/compare_plans.py --write DIR      # compile every row, save its plan (the baseline)
    python benchmarks/compare_plans.py --check DIR      # rebuild every row here, compare with DIR

A refactoring of the lowering, verify, the simulator or the IR must not change a plan: the same
decisions, the same ops (with their dependencies) and the same predictions.  ``--write`` compiles each
row as its table does and saves the plan's JSON (pass timings and solver seconds stripped).
``--check`` rebuilds each saved row with this checkout and compares, field by field:

- heuristic rows (``megatrain``, ``recompute-all``, ``keep-all``) are compiled again from scratch
  (deterministic: the micro-batch search and every plan it builds);
- rows whose plan came from the MILP are rebuilt from the baseline's *decisions* (lower, verify,
  simulate), since a solver under a time limit is not deterministic and is not what is compared.

Differences are reported per part: ``decisions``, ``ops`` (everything but ``deps``), ``deps`` (edges
added / removed), ``predicted``.  ``--only SUBSTR`` limits the rows, ``--time-limit S`` caps each MILP
solve of ``--write`` (on 2 cores the whole grid takes minutes; the 72B row alone about one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import milp_table  # noqa: E402
import policy_table  # noqa: E402

from lazytrain.compiler.api import Compiler, compile_model  # noqa: E402
from lazytrain.compiler.profiles import get_profile  # noqa: E402
from lazytrain.frontend.presets import build_model  # noqa: E402
from lazytrain.frontend.trace import trace  # noqa: E402
from lazytrain.ir import Decisions, PlanError  # noqa: E402
from lazytrain.ir.graph import ModelGraph  # noqa: E402

HEURISTIC = ("megatrain", "recompute-all", "keep-all")
#: decision fields removed as dead code (never set by any policy): a baseline may hold them, empty
REMOVED_DECISIONS = {"update_window": [], "offload_window": [], "reload_window": [], "prefetch": 1}


def rows() -> list[dict]:
    """Every compile of the two tables: name, model, batch, budgets, policy, resident."""
    out = []
    for model in policy_table.MODELS:
        for batch in policy_table.BATCHES:
            for policy in policy_table.POLICIES:
                out.append({"name": f"policy_{model}_b{batch}_24GiB_{policy}", "model": model, "batch": batch,
                            "gpu": "24GiB", "host": None, "policy": policy, "resident": "auto"})
    model, batch, gpu, host = policy_table.BIG
    out.append({"name": f"policy_{model}_b{batch}_{gpu}_milp", "model": model, "batch": batch, "gpu": gpu,
                "host": host, "policy": "milp", "resident": "auto"})
    for model in milp_table.MODELS:
        for gb in milp_table.GPU_GIB:
            for batch in milp_table.BATCHES:
                for pol, res in milp_table.POLICIES:
                    out.append({"name": f"milp_{model}_b{batch}_{gb}GiB_{pol}", "model": model, "batch": batch,
                                "gpu": f"{gb}GiB", "host": "1TiB", "policy": "milp" if pol == "default" else pol,
                                "resident": res})
    return out


_GRAPHS: dict = {}


def graph(model: str):
    if model not in _GRAPHS:
        _GRAPHS[model] = trace(build_model(model), seq_len=1024)
    return _GRAPHS[model]


def normalized(plan_json: dict) -> dict:
    """The parts compared: decisions, ops, predicted, budgets and options (timings stripped)."""
    dec = dict(plan_json["decisions"])
    for key, empty in REMOVED_DECISIONS.items():
        if key in dec:
            if dec[key] != empty:
                raise SystemExit(f"baseline decisions hold {key}={dec[key]!r}: not dead code after all")
            del dec[key]
    solver = plan_json.get("solver")
    return {"decisions": dec, "ops": plan_json["ops"], "predicted": plan_json["predicted"],
            "graph": plan_json["graph"],
            "budgets": plan_json["budgets"], "options": plan_json["options"],
            "solver": None if solver is None else {k: v for k, v in solver.items() if k != "seconds"}}


def compile_row(row: dict, time_limit: float | None):
    kw = {"host_memory": row["host"]} if row["host"] else {}
    return compile_model(graph(row["model"]), batch_size=row["batch"], gpu_memory=row["gpu"], policy=row["policy"],
                         resident=row["resident"], time_limit=time_limit, **kw)


def rebuild(saved: dict) -> dict:
    """Lower, verify and simulate the saved plan's decisions with this checkout."""
    dec = Decisions.from_json(saved["decisions"])
    opts = saved["options"]
    # the graph the plan was built on (the loss head's chunk as the compile chose it, single pass or not)
    g = ModelGraph.from_json(saved["graph"])
    comp = Compiler(g, get_profile("h200"), saved["budgets"], param_dtype="bfloat16",
                    optimizer=opts["optimizer"], clip=opts["clip"], resident=dec.resident_blocks)
    return normalized(comp.build(dec, saved["batch"]).to_json())


def diff(want: dict, got: dict, *, rebuilt: bool) -> tuple[dict[str, str], bool]:
    """What differs, per part ('' where equal), and whether the plans agree but for added dependencies."""
    out = {"decisions": "" if want["decisions"] == got["decisions"] else "differ"}
    w_ops, g_ops = want["ops"], got["ops"]
    removed = 0
    if len(w_ops) != len(g_ops):
        out["ops"] = f"{len(w_ops)} -> {len(g_ops)} ops"
        out["deps"] = "n/a"
    else:
        bad = [i for i, (a, b) in enumerate(zip(w_ops, g_ops)) if {**a, "deps": 0} != {**b, "deps": 0}]
        out["ops"] = f"{len(bad)} ops differ (first #{bad[0]})" if bad else ""
        added = sum(len(set(b["deps"]) - set(a["deps"])) for a, b in zip(w_ops, g_ops))
        removed = sum(len(set(a["deps"]) - set(b["deps"])) for a, b in zip(w_ops, g_ops))
        out["deps"] = f"+{added} -{removed} edges" if added or removed else ""
    keys = set(got["predicted"]) if rebuilt else set(want["predicted"]) | set(got["predicted"])
    changed = sorted(k for k in keys if want["predicted"].get(k) != got["predicted"].get(k))
    out["predicted"] = ", ".join(f"{k} {want['predicted'].get(k)} -> {got['predicted'].get(k)}"
                                 if k == "step_time_s" else k for k in changed)
    if not rebuilt:
        out["solver"] = "" if want["solver"] == got["solver"] else "differ"
    same = not removed and all(v == "" for k, v in out.items() if k != "deps")
    return out, same


def write(directory: Path, selected: list[dict], time_limit: float | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for row in selected:
        t = time.perf_counter()
        try:
            plan = compile_row(row, time_limit)
        except PlanError as e:
            saved = {**row, "error": str(e).split("\n")[0]}
        else:
            saved = {**row, **normalized(plan.to_json())}
            # the check rebuilds MILP rows from their decisions: that path must reproduce the plan here too
            if row["policy"] not in HEURISTIC:
                d, _ = diff(saved, rebuild(saved), rebuilt=True)
                if any(d.values()):
                    raise SystemExit(f"{row['name']}: rebuilding from the decisions does not reproduce the plan: {d}")
        (directory / f"{row['name']}.json").write_text(json.dumps(saved, indent=0, sort_keys=True))
        step = saved.get("predicted", {}).get("step_time_s")
        print(f"{row['name']}: {'does not fit' if step is None else f'{step:.4f} s'} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)


def check(directory: Path, only: str | None) -> int:
    files = sorted(p for p in directory.glob("*.json") if not only or only in p.name)
    if not files:
        raise SystemExit(f"no baseline plans in {directory}")
    bad = 0
    print("| row | how | decisions | ops | deps | predicted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in files:
        saved = json.loads(path.read_text())
        if "error" in saved:
            try:
                compile_row(saved, None)
                got = "now compiles"
            except PlanError as e:
                got = "" if str(e).split("\n")[0] == saved["error"] else f"another error: {e}"
            bad += bool(got)
            print(f"| {saved['name']} | compile | does not fit {'(same)' if not got else got} | | | |")
            continue
        heuristic = saved["decisions"]["policy"] in HEURISTIC and saved["policy"] in HEURISTIC
        got = normalized(compile_row(saved, None).to_json()) if heuristic else rebuild(saved)
        d, same = diff(saved, got, rebuilt=not heuristic)
        bad += not same
        cells = [d["decisions"] or "same", d["ops"] or "same", d["deps"] or "same", d["predicted"] or "same"]
        print(f"| {saved['name']} | {'compile' if heuristic else 'rebuild'} | {' | '.join(cells)} |", flush=True)
    print(f"\n{len(files)} rows, {bad} with a difference other than added dependencies")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="DIR", help="compile every row and save the plans here")
    mode.add_argument("--check", type=Path, metavar="DIR", help="rebuild every saved row and compare")
    ap.add_argument("--only", default=None, help="only rows whose name contains this")
    ap.add_argument("--time-limit", type=float, default=None, help="MILP time limit per solve (--write)")
    a = ap.parse_args()
    if a.write:
        write(a.write, [r for r in rows() if not a.only or a.only in r["name"]], a.time_limit)
    else:
        sys.exit(check(a.check, a.only))


if __name__ == "__main__":
    main()
