"""Each policy's predicted step time and peak GPU memory (issue 2's table), and the 72B compile time.

    python benchmarks/policy_table.py

h200 profile, seq 1024, 24 GiB; no GPU needed.
"""

from __future__ import annotations

import subprocess
import sys

from lazytrain.compiler.api import compile_model
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import GiB, PlanError

#: the compile-time row: (model, batch, GPU memory, host memory), default policy (the MILP, resident "auto")
BIG = ("qwen2.5-72b", 72, "80GiB", "1TiB")
COMPILE_72B = ("import time, resource; t = time.time(); from lazytrain.compiler.api import compile_model; "
               f"compile_model({BIG[0]!r}, batch_size={BIG[1]}, gpu_memory={BIG[2]!r}, host_memory={BIG[3]!r}); "
               f"print(f'{BIG[0]} batch {BIG[1]} at {BIG[2]}: compiled in {{time.time() - t:.1f}} s, max RSS '"
               "f'{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB')")
#: the table's rows: every (model, batch, policy), at 24 GiB
MODELS, BATCHES, POLICIES = ("qwen2.5-3b", "qwen2.5-7b"), (8, 32), ("megatrain", "recompute-all", "keep-all", "milp")


def main() -> None:
    print("| model | batch | policy | predicted step s | micro-batch | peak GPU GiB | model TFLOPS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        g = trace(build_model(model), seq_len=1024)
        for batch in BATCHES:
            for policy in POLICIES:
                try:
                    p = compile_model(g, batch_size=batch, gpu_memory="24GiB", policy=policy)
                    print(f"| {model} | {batch} | {policy} | {p.predicted['step_time_s']:.3f} | {p.micro_batch} | "
                          f"{p.predicted['peak_gpu_bytes'] / GiB:.1f} | {p.predicted['model_tflops']:.0f} |")
                except PlanError as e:
                    print(f"| {model} | {batch} | {policy} | does not fit: {str(e)[:70]} | | | |")
    r = subprocess.run([sys.executable, "-c", COMPILE_72B], capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr.strip()[-300:])



if __name__ == "__main__":
    main()
