"""Predicted effect of GPU-updated streamed blocks (``compile(..., gpu_update=...)``), on the simulator only.

For each batch: the plan compiled with ``gpu_update="none"`` and with ``"auto"`` (the rule of
``lazytrain/compiler/gpu_update.py``), their predicted step, model TFLOPS, GPU idle time, host (cpu) busy time,
resident and GPU-updated blocks and peak GPU memory, and for ``"auto"`` the step of the solved plan the rule
started from (``baseline_step_s``: the same search's, where the two compiles' searches, bounded by CPU time,
may have found different plans).  No GPU is needed.

``--layer-ms FWD,BWD@MB`` stands in for a calibration (``--calibrate`` on the GPU): every block of the model's
most common signature (its decoder layers) is timed at FWD ms forward (recompute the same) and BWD ms backward
at micro-batch MB, scaled linearly to the other micro-batches.  The built-in profiles model a block from its
FLOPs, which on the H200 with compiled blocks comes out slower than measured: the modelled plan is then paced by
the GPU, where the measured one is paced by the host update (``benchmarks/results/design_measurements.md``).

    python benchmarks/gpu_update_predicted.py --model qwen2.5-3b --gpu-memory 24GiB --batch 32,8 --compile-blocks
    python benchmarks/gpu_update_predicted.py --model qwen2.5-3b --gpu-memory 24GiB --batch 32,8 --compile-blocks \\
        --layer-ms 7.5,17.3@32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

import lazytrain
from lazytrain.compiler.block_timing import BlockTiming
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.simulate import simulate
from lazytrain.ir import GiB


def layer_timed(graph, hw, spec: str, micro_batches):
    """``hw`` with the decoder layers timed as ``FWD,BWD@MB`` says (module docstring)."""
    times, mb = spec.split("@")
    fwd, bwd = (float(x) / 1e3 for x in times.split(","))
    sig, _ = Counter(graph.block_signature(j) for j in range(graph.n_blocks)).most_common(1)[0]
    rows = [BlockTiming(signature=sig, block="decoder layer (given)", micro_batch=m, seq_len=graph.seq_len,
                        forward_s=fwd * m / int(mb), backward_s=bwd * m / int(mb), recompute_s=fwd * m / int(mb),
                        samples=1) for m in micro_batches]
    return dataclasses.replace(hw, calibration=tuple(rows))


def row(plan) -> dict:
    pred, dec = plan.predicted, plan.decisions
    sim = simulate(plan)
    return {"step_s": round(pred["step_time_s"], 4), "model_tflops": round(pred["model_tflops"], 1),
            "gpu_idle_s": round(sim.gpu_idle_s, 4), "cpu_busy_s": round(pred["busy_s"]["cpu"], 4),
            "micro_batch": plan.micro_batch, "resident": len(dec.resident_blocks),
            "gpu_updated": sorted(dec.gpu_updated_blocks), "peak_gpu_gib": round(pred["peak_gpu_bytes"] / GiB, 2),
            "budget_gib": round(plan.budgets["gpu_bytes"] / GiB, 2),
            "baseline_step_s": (dec.notes.get("gpu_update") or {}).get("baseline_step_s"),
            "rule_s": (dec.notes.get("gpu_update") or {}).get("seconds")}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-3b")
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--batch", default="32,8", help="comma-separated batch sizes")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--compile-blocks", action="store_true")
    ap.add_argument("--layer-ms", default=None, metavar="FWD,BWD@MB", help="time the decoder layers so (docstring)")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("-o", "--out", default=None, help="write the rows as JSON")
    a = ap.parse_args(argv)
    hw = get_profile(a.hardware)
    out = []
    for batch in (int(b) for b in a.batch.split(",")):
        common = dict(batch_size=batch, seq_len=a.seq, gpu_memory=a.gpu_memory, compile_blocks=a.compile_blocks,
                      time_limit=a.time_limit)
        model = a.model
        if a.layer_ms:      # trace once, then time its layers
            model = lazytrain.compile(a.model, hardware=hw, gpu_update="none", **common).graph
            hw_b = layer_timed(model, hw, a.layer_ms, [m for m in range(1, batch + 1) if batch % m == 0])
        else:
            hw_b = hw
        for mode in ("none", "auto"):
            plan = lazytrain.compile(model, hardware=hw_b, gpu_update=mode, **common)
            r = {"model": a.model, "batch": batch, "gpu_memory": a.gpu_memory, "gpu_update": mode,
                 "layer_ms": a.layer_ms, **row(plan)}
            print(json.dumps(r), flush=True)
            out.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
