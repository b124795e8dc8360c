"""The simulator's predicted scaling over 1, 2, 4 and 8 GPUs of the h200 profile (issue 18's table).

    python benchmarks/multi_gpu_predicted.py [--time-limit S] [-o benchmarks/results/multi_gpu_predicted.md]

PREDICTED, not measured: every figure is the simulator's step time of the compiled plan (MILP policy,
seq 1024, the whole H200's memory per GPU, the resident prefix the MILP's choice at every world size), with
the h200 profile's collective figures, which are modelled (NVLink 4 class, ``compiler/hardware.py``), not
measured.  Per-GPU batch 32 and 8; host
memory of the machine kinds lent: 128 GiB for 1 GPU, 256, 512 and 560 GiB for 2, 4 and 8 (one host).
No GPU needed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lazytrain.compiler.api import compile_model
from lazytrain.frontend.presets import build_model
from lazytrain.frontend.trace import trace
from lazytrain.ir import PlanError

MODELS = ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b")
BATCHES = (32, 8)
#: GPUs -> host memory of the machine kind with that many H200s
HOSTS = {1: "128GiB", 2: "256GiB", 4: "512GiB", 8: "560GiB"}


def row(graph, batch: int, gpus: int, time_limit: float) -> dict:
    try:
        plan = compile_model(graph, batch_size=batch, host_memory=HOSTS[gpus], world_size=gpus,
                             time_limit=time_limit)
    except PlanError as e:
        return {"error": str(e).split(";")[0]}
    p = plan.predicted
    return {"step_s": p["step_time_s"], "tokens_s": p["tokens_per_s"] * gpus, "tflops_gpu": p["model_tflops"],
            "micro": f"{plan.micro_batch} x {plan.n_micro}", "net_s": p["busy_s"].get("net", 0.0),
            "cpu_s": p["busy_s"]["cpu"], "resident": len(plan.decisions.resident_blocks),
            "milp": "milp_fallback" not in plan.decisions.notes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=4.0, help="MILP seconds per solve")
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).parent / "results" / "multi_gpu_predicted.md")
    a = ap.parse_args()
    lines = ["# Multi-GPU scaling, PREDICTED by the simulator (not measured)", "",
             "`python benchmarks/multi_gpu_predicted.py` -- h200 profile (collective bandwidth and latency "
             "modelled, not measured), seq 1024, MILP policy, ZeRO-3 sharding of the host state over the GPUs of "
             "one host; host memory 128 / 256 / 512 / 560 GiB for 1 / 2 / 4 / 8 GPUs. tokens/s is the whole "
             "world's; model TFLOPS is per GPU (6 x params x tokens / step).", "",
             "| model | batch per GPU | GPUs | predicted step s | tokens/s (all GPUs) | model TFLOPS per GPU | "
             "speed-up | micro-batch | collective busy s | host update busy s | resident blocks |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    t0 = time.time()
    for model in MODELS:
        graph = trace(build_model(model), seq_len=1024)
        for batch in BATCHES:
            base = None
            for gpus in HOSTS:
                r = row(graph, batch, gpus, a.time_limit)
                if "error" in r:
                    lines.append(f"| {model} | {batch} | {gpus} | does not fit: {r['error']} | | | | | | | |")
                    continue
                base = base or (r["tokens_s"] / gpus if gpus == 1 else None)
                speed = f"{r['tokens_s'] / base:.2f}x" if base else ""
                lines.append(f"| {model} | {batch} | {gpus} | {r['step_s']:.3f} | {r['tokens_s']:.0f} | "
                             f"{r['tflops_gpu']:.1f} | {speed} | {r['micro']} | {r['net_s']:.3f} | {r['cpu_s']:.3f} | "
                             f"{r['resident']}{'' if r['milp'] else ' (heuristic plan: the MILP had none)'} |")
                print(lines[-1], flush=True)
    lines += ["", f"Compiled in {time.time() - t0:.0f} s on a 2-core machine without a GPU."]
    a.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
