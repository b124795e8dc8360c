"""Render ``run_plan.py --runs ... -o runs.json`` results as a markdown table and a model-TFLOPS chart.

    python benchmarks/runs_report.py benchmarks/results/h200_2026-11-29_3b_24GiB.json \\
        benchmarks/results/h200_2026-11-29_3b_80GiB.json -o benchmarks/results/h200_qwen2.5-3b

Writes ``<out>.md`` (one row per run: step time measured and predicted, model TFLOPS, peak GPU memory
measured and predicted, host RSS, exposed update, hidden transfer fractions) and ``<out>.png``
(model TFLOPS per run, with the peers measured on the same machine as reference bars:
benchmarks/results/h200_reference.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: benchmarks/results/h200_reference.md, the same H200 machine, qwen2.5-3b shape, seq 1024 (model TFLOPS)
PEERS = {"MegaTrain b8": 46.8, "MegaTrain b32": 128.9, "FSDP2 offload b8": 48.4, "FSDP2 offload b32": 135.1,
         "plain PyTorch b8 (whole GPU)": 362.9}

HEADER = ["cap", "policy", "batch", "micro-batch", "step s", "predicted s", "predicted / measured", "model TFLOPS",
          "peak GiB measured / predicted", "host RSS GiB", "exposed / total update s", "hidden under compute"]


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        runs += data if isinstance(data, list) else [data]
    return runs


def row(r: dict) -> list[str]:
    if "error" in r:
        return [r.get("gpu_memory", ""), r["policy"], str(r["batch"]), f"failed: {r['error'][:100]}"] + [""] * 8
    hidden = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["hidden"].items())
    return [r["gpu_memory"], r["policy"], str(r["batch"]), str(r["micro_batch"]), f"{r['median_step_s']:.3f}",
            f"{r['predicted_step_s']:.3f}", f"{r['predicted_step_s'] / r['median_step_s']:.3f}",
            f"{r['model_tflops']:.1f}", f"{r['measured_peak_gpu_gib']:.2f} / {r['predicted_peak_gpu_gib']:.2f}",
            f"{r['host_rss_gib']:.1f}", f"{r['exposed_update_s']:.2f} / {r['update_s']:.2f}", hidden]


def markdown(runs: list[dict], sources: list[str], commands: list[str] = ()) -> str:
    first = next((r for r in runs if "error" not in r), runs[0])
    lines = [f"# LazyTrain on {first.get('device', 'the GPU')}: random-init {first['model']} shape, seq {first['seq']}",
             "", "Runs (each file is one `benchmarks/run_plan.py --runs ...` process): "
             + ", ".join(f"`{s}`" for s in sources), ""]
    lines += [f"- `{c}`" for c in commands] + ([""] if commands else [])
    lines += ["| " + " | ".join(HEADER) + " |", "| " + " | ".join("---" for _ in HEADER) + " |"]
    lines += ["| " + " | ".join(row(r)) + " |" for r in runs]
    lines += ["", "Peers on the same machine (h200_reference.md), model TFLOPS: "
              + "; ".join(f"{k} {v}" for k, v in PEERS.items()) + "."]
    return "\n".join(lines) + "\n"


def chart(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in runs if "error" not in r]
    labels = [f"LazyTrain {r['policy']} b{r['batch']} {r['gpu_memory']}" for r in ok] + list(PEERS)
    values = [r["model_tflops"] for r in ok] + list(PEERS.values())
    colors = ["tab:blue"] * len(ok) + ["tab:gray"] * len(PEERS)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.2))
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.0f}", va="center")
    ax.set_xlabel("model TFLOPS (6 · params · tokens / step s)")
    if ok:
        ax.set_title(f"{ok[0]['model']} shape, seq {ok[0]['seq']}, {ok[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run_plan.py JSON outputs")
    ap.add_argument("-o", "--out", required=True, help="output path without extension")
    ap.add_argument("--command", action="append", default=[], help="the command that made a runs file (listed)")
    a = ap.parse_args(argv)
    runs = load_runs(a.runs)
    md, png = Path(a.out + ".md"), Path(a.out + ".png")     # not with_suffix: "qwen2.5-3b" has a dot
    md.write_text(markdown(runs, a.runs, a.command))
    chart(runs, png)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
