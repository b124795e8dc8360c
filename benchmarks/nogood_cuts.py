"""No-good cuts on long chains, measured: the default MILP compile's predicted step with ``NO_GOOD_CUTS_LONG``
at 3 (the setting before) and 0 (tighten the budget at once), per preset x GPU budget x batch.

    python benchmarks/nogood_cuts.py qwen2.5-7b,llama3-8b,qwen2.5-3b,qwen2.5-14b,qwen2.5-32b > rows.jsonl

One JSON line a row (h200 profile, seq 1024, host 1 TiB so the GPU budget binds): per setting the predicted
step, the plan's policy (a heuristic where the search fell back) and whether the deadline ran out.  The table
of ``benchmarks/results/nogood_cuts.md`` is made from these lines.
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import lazytrain
from lazytrain.compiler import search
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import PlanError

SETTINGS = (3, 0)


def row(graph, model: str, gb: int, batch: int) -> dict:
    out = {"model": model, "gb": gb, "batch": batch}
    for n in SETTINGS:
        search.NO_GOOD_CUTS_LONG = n
        t = time.process_time()
        try:
            p = lazytrain.compile(graph, batch_size=batch, gpu_memory=f"{gb}GiB", host_memory="1TiB", policy="milp")
            out |= {f"step{n}": round(p.predicted["step_time_s"], 4), f"pol{n}": p.decisions.policy,
                    f"oot{n}": bool(p.solver and p.solver.out_of_time)}
        except PlanError:
            out[f"step{n}"] = None
        out[f"cpu{n}"] = round(time.process_time() - t, 1)
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    for model in sys.argv[1].split(","):
        graph = trace(build_model(model), seq_len=1024)
        for gb in (24, 48, 80):
            for batch in (8, 32, 72):
                print(json.dumps(row(graph, model, gb, batch)), flush=True)


if __name__ == "__main__":
    main()
