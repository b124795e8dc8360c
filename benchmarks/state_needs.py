"""What host memory and NVMe a model's training state needs: in host memory only, and with all of it that can go to
NVMe there (``compiler/state_placement.py``), for the 8-bit optimizer (8.25 bytes a parameter) and its
stochastic-rounding master (6.25).  The least host figure is the state's: the plan adds the activations it
offloads to the host (``lazytrain compile`` prints its own peak).

    python benchmarks/state_needs.py -o benchmarks/results/issue41_state_on_nvme/needs.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lazytrain.compiler import pipeline
from lazytrain.compiler.profiles import get_profile
from lazytrain.compiler.request import CompileRequest
from lazytrain.compiler.state_placement import fullest
from lazytrain.ir import GiB

MODELS = ("qwen2.5-3b", "llama3-8b", "qwen2.5-14b", "qwen3-32b", "llama3-70b", "qwen2.5-72b")
OPTIMIZERS = ("hybrid8bit", "hybrid8bit-sr")


def row(model: str, optimizer: str) -> dict:
    req = CompileRequest.of(model, batch_size=16, seq_len=1024, hardware="workstation", optimizer=optimizer,
                            nvme_dir="/nvme", nvme_memory="64TiB", seq_tile=None)
    hw = get_profile(req.hardware)
    graph = pipeline.resolve_graph(model, req, [])
    comp = pipeline.compiler_for(graph, hw, pipeline.budgets_for(req, hw), req)
    least = fullest(comp)
    total = int(graph.total_params * comp.options["host_bytes_per_param"])
    return {"model": model, "params_b": graph.total_params / 1e9, "optimizer": optimizer,
            "bytes_per_param": comp.options["host_bytes_per_param"], "ram_only_gib": total / GiB,
            "least_host_gib": least.host_bytes / GiB, "nvme_gib": least.nvme_bytes / GiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    lines = ["| model | params | optimizer | state in host memory only | least host memory with state on NVMe "
             "| NVMe it then takes |", "|---|---:|---|---:|---:|---:|"]
    for model in MODELS:
        for opt in OPTIMIZERS:
            r = row(model, opt)
            lines.append(f"| {model} | {r['params_b']:.1f} B | {opt} ({r['bytes_per_param']} B/param) | "
                         f"{r['ram_only_gib']:.0f} GiB | {r['least_host_gib']:.1f} GiB | {r['nvme_gib']:.0f} GiB |")
            print(lines[-1], flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
