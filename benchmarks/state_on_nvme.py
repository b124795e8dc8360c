"""What a workstation trains with its state on NVMe: compiles (no GPU needed) of 32B-72B models on a 24 GiB GPU
(the profiles' RTX 4090, its whole memory) with 64-128 GiB of host memory and 1 TiB of NVMe, on one drive and on
a 4-drive array; per row the predicted step,
model TFLOPS, where the state lives, what paces the step, the peaks and the compile's wall time.

    python benchmarks/state_on_nvme.py -o benchmarks/results/issue41_state_on_nvme

Each compile runs as the CLI does (``lazytrain compile``, its own process: the wall time is a user's); the rows
go to ``table.md`` and ``rows.json`` in the output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: (model, host memory, batches) for each of the two NVMe profiles
ROWS = [("llama3-70b", "128GiB", (16, 32, 64)), ("qwen2.5-72b", "128GiB", (16, 32, 64)),
        ("qwen3-32b", "64GiB", (16, 32, 64))]
PROFILES = ("workstation", "workstation-4nvme")
GiB = 2**30


def compile_row(model: str, host: str, batch: int, hardware: str, folder: Path) -> dict:
    out = folder / f"{model}_{hardware}_b{batch}.json"
    cmd = [sys.executable, "-m", "lazytrain", "compile", model, "--batch", str(batch), "--seq", "1024",
           "--host-memory", host, "--nvme-dir", str(folder / "nvme"), "--nvme-memory",
           "1TiB", "--hardware", hardware, "-o", str(out), "--progress", "off"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    row = {"model": model, "hardware": hardware, "host": host, "batch": batch, "compile_s": round(wall, 2),
           "command": "lazytrain " + " ".join(cmd[3:-4]).replace(str(folder / "nvme"), "NVME_DIR")}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return row
    plan = json.loads(out.read_text())
    pred, dec = plan["predicted"], plan["decisions"]
    busy = {k: v for k, v in pred["busy_s"].items() if v}
    row.update(step_s=round(pred["step_time_s"], 2), model_tflops=round(pred["model_tflops"], 1),
               tokens_per_s=round(pred["tokens_per_s"], 1), peak_gpu_gib=round(pred["peak_gpu_bytes"] / GiB, 2),
               peak_host_gib=round(pred["peak_host_bytes"] / GiB, 2),
               peak_nvme_gib=round(pred["peak_nvme_bytes"] / GiB, 2),
               host_store_gib=round(pred["host_static_bytes"] / GiB, 2),
               nvme_state={k: len(v) for k, v in dec.get("nvme_state", {}).items()},
               paced_by=max(busy, key=busy.get), busy_s={k: round(v, 1) for k, v in busy.items()},
               micro_batch=dec["micro_batch"], policy=dec["policy"])
    out.unlink()
    return row


def table(rows: list[dict]) -> str:
    head = ("| model | profile | host | batch | step s | model TFLOPS | tokens/s | state on NVMe (blocks: ostate / "
            "grads / params) | paced by (busy s) | peak GPU / host / NVMe GiB | compile s |\n"
            "|---|---|---|---:|---:|---:|---:|---|---|---|---:|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['hardware']} | {r['host']} | {r['batch']} | - | - | - | {r['error']} "
                         f"| - | - | {r['compile_s']} |")
            continue
        st = r["nvme_state"]
        placed = " / ".join(str(st.get(k, 0)) for k in ("ostate", "grads", "params"))
        pace = f"{r['paced_by']} ({r['busy_s'][r['paced_by']]})"
        lines.append(f"| {r['model']} | {r['hardware']} | {r['host']} | {r['batch']} | {r['step_s']} | "
                     f"{r['model_tflops']} | {r['tokens_per_s']} | {placed} | {pace} | {r['peak_gpu_gib']} / "
                     f"{r['peak_host_gib']} / {r['peak_nvme_gib']} | {r['compile_s']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="folder for table.md and rows.json")
    ap.add_argument("--only", default="", help="comma-separated models to run (default all)")
    args = ap.parse_args()
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, host, batches in ROWS:
            if only and model not in only:
                continue
            for hardware in PROFILES:
                for batch in batches:
                    row = compile_row(model, host, batch, hardware, Path(tmp))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
            "command": "python benchmarks/state_on_nvme.py -o " + args.output}
    (folder / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (folder / "table.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
