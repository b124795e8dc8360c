"""Does a long-context plan use the GPU budget where its step is not the GPU's compute alone? (issue 20's goal)

    python benchmarks/long_context_budget.py [ROWS]     # ROWS: indices into ROWS below, e.g. 1,2,3,4

Compiles each row of the long-context table (batch 1, 24 GiB cap, MILP, the h200 profile's modelled figures, the
default ``gpu_update``) and prints, one JSON line a row, the predicted step, the GPU's busy share of it (1.0: the
step is the GPU's compute alone) and the plan's peak against the cap.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
warnings.simplefilter("ignore")

from run_plan import scaled_rope_config  # noqa: E402

import lazytrain  # noqa: E402
from lazytrain.compiler.simulate import simulate  # noqa: E402

#: (preset, rope scaling, sequence, host budget): the rows of the README's long-context table
ROWS = [("qwen2.5-3b", "yarn:4", 8192, None), ("qwen2.5-3b", "yarn:4", 32768, None),
        ("qwen2.5-3b", "yarn:4", 65536, None), ("qwen2.5-7b", None, 8192, None),
        ("qwen2.5-7b", None, 32768, "60GiB"), ("qwen2.5-7b", None, 65536, None),
        ("qwen2.5-7b", None, 131072, None), ("qwen2.5-3b", "yarn:4", 245760, None)]


def main(argv: list[str]) -> None:
    only = [int(x) for x in argv[0].split(",")] if argv else range(len(ROWS))
    for i in only:
        preset, rope, seq, host = ROWS[i]
        t = time.perf_counter()
        plan = lazytrain.compile(scaled_rope_config(preset, rope) if rope else preset, batch_size=1, seq_len=seq,
                                 gpu_memory="24GiB", host_memory=host, hardware="h200", policy="milp")
        sim = simulate(plan)
        print(json.dumps({"model": preset, "seq": seq, "host_memory": host, "step_s": round(sim.step_time_s, 3),
                          "gpu_busy_share": round(sim.busy_s["gpu"] / sim.step_time_s, 3),
                          "peak_gib": round(sim.peak_gpu_bytes / 2**30, 2),
                          "peak_of_cap": round(sim.peak_gpu_bytes / 2**30 / 24, 3),
                          "resident": len(plan.decisions.resident_blocks),
                          "gpu_updated": len(plan.decisions.gpu_updated_blocks),
                          "compile_s": round(time.perf_counter() - t, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
