"""Bench results (``lazytrain.bench/1`` JSON) -> a markdown table and a PNG bar chart of model TFLOPS.

    python benchmarks/report.py benchmarks/results/bench_qwen2.5-3b_b8_s1024_24GiB.json [-o OUT_STEM]

``lazytrain bench`` calls ``write_report`` itself; this script re-renders a saved result.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ["system", "batch", "step s", "model TFLOPS", "hardware TFLOPS", "tokens/s", "peak GPU GiB",
           "host RSS GiB", "predicted step s", "predicted / measured"]


def _f(v, fmt: str) -> str:
    if v is None:
        return ""
    return format(v, ".3g") if fmt == ".1f" and abs(v) < 1 else format(v, fmt)   # tiny CPU runs stay readable


def max_batch_cell(r: dict) -> str:
    """The batch search's answer for one row: the batch, and whether it was run or only predicted."""
    if "max_batch" not in r and "max_batch_error" not in r:
        return ""
    if r.get("max_batch") is None:
        tries = r.get("max_batch_tries") or []
        if tries and _try_outcome(tries[-1]["error"]) != "out of memory":     # the search had no answer
            return f"none found: batch {tries[-1]['batch']} {_try_outcome(tries[-1]['error'])}"
        return r.get("max_batch_note") or (r.get("max_batch_error") or "none").replace("|", "/")
    b = r["max_batch"]
    if r.get("max_batch_verified") is False:
        return f"{b} (predicted; not run)"
    if r.get("max_batch_verified"):
        return f"{b} (ran: {r['max_batch_step_s']:.1f} s/step, mb {r.get('max_batch_micro_batch')})"
    return f">= {b} ({r['max_batch_note']})" if r.get("max_batch_note") else str(b)


def table_rows(result: dict) -> list[list[str]]:
    search = result["config"].get("find_max_batch")
    rows = []
    for r in result["rows"]:
        tail = [max_batch_cell(r)] if search else []
        if r.get("error"):
            rows.append([r["system"], str(r.get("batch", "")), r["error"].replace("|", "/")]
                        + [""] * (len(COLUMNS) - 3) + tail)
            continue
        name = r["system"] + (f" ({len(r['resident_blocks'])} blocks resident)" if r.get("resident_blocks") else "")
        rows.append([name, str(r["batch"]), _f(r["median_step_s"], ".3f"), _f(r["model_tflops"], ".1f"),
                     _f(r["hardware_tflops"], ".1f"), _f(r["tokens_per_s"], ",.0f"), _f(r["peak_gpu_gib"], ".2f"),
                     _f(r["host_rss_gib"], ".2f"), _f(r.get("predicted_step_s"), ".3f"),
                     _f(r.get("predicted_over_measured"), ".2f")] + tail)
    return rows


def markdown(result: dict) -> str:
    c, m = result["config"], result["machine"]
    lines = [f"# Benchmark: {c['model']}, batch {c['batch']}, seq {c['seq']}, GPU cap {c['gpu_memory']}", "",
             f"- command: `{result['command']}`", f"- date: {result['date']}",
             f"- machine: {m['gpu']}; {m['cpu']}, {m['cpu_cores']} CPU cores, {m['host_ram_gib']} GiB host RAM",
             f"- {c['warmup']} warm-up + {c['steps']} measured steps (median), same seeded random tokens for every "
             f"system; model TFLOPS = 6 · params · batch · seq / step s; hardware TFLOPS counts recompute "
             f"(lazytrain: the plan's op FLOPs; checkpointing baselines 8 · params · tokens, "
             f"plain 6 · params · tokens)",
             ""]
    cols = COLUMNS + (["largest batch under the cap"] if c.get("find_max_batch") else [])
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(result)]
    tries = [(r["system"], r["max_batch_tries"]) for r in result["rows"] if r.get("max_batch_tries")]
    if tries:
        lines += ["", "Largest-batch tries, one step each (baselines): " + "; ".join(
            f"{s}: " + ", ".join(f"{t['batch']} {_try_outcome(t['error'])}" for t in ts) for s, ts in tries)]
    return "\n".join(lines) + "\n"


def _try_outcome(error: str | None) -> str:
    if not error:
        return "fits"
    if "out of memory" in error:
        return "out of memory"
    return "timed out" if error.startswith("timed out") else "failed"


def bar_chart(result: dict, path) -> Path | None:
    """Model TFLOPS per system; a failed system is a labelled empty bar.  None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: the bar chart needs matplotlib (pip install matplotlib)")
        return None
    rows = result["rows"]
    names = [f"{r['system']}\nbatch {r.get('batch')}" for r in rows]
    vals = [0.0 if r.get("error") else r["model_tflops"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(rows), 4))
    bars = ax.bar(names, vals, color=["#4c72b0" if r["system"].startswith("lazytrain") else "#999999" for r in rows])
    top = max(vals + [1e-9])
    for b, r, v in zip(bars, rows, vals):
        label = ("OOM" if "out of memory" in r["error"] else "failed") if r.get("error") else _f(v, ".1f")
        ax.text(b.get_x() + b.get_width() / 2, v + 0.01 * top, label, ha="center", va="bottom", fontsize=9)
    c = result["config"]
    ax.set_ylabel("model TFLOPS")
    ax.set_title(f"{c['model']}, batch {c['batch']}, seq {c['seq']}, GPU cap {c['gpu_memory']}\n"
                 f"{result['machine']['gpu']}", fontsize=10)
    ax.set_ylim(0, top * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_report(result: dict, md_path, png_path) -> tuple[str, Path | None]:
    md = markdown(result)
    Path(md_path).write_text(md)
    return md, bar_chart(result, png_path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result")
    ap.add_argument("-o", "--out", default=None, help="output stem (default: the JSON's, next to it)")
    a = ap.parse_args(argv)
    result = json.loads(Path(a.result).read_text())
    # not with_suffix: a stem such as "bench_qwen2.5-3b_b8" has a dot of its own
    stem = a.out or (a.result[:-len(".json")] if a.result.endswith(".json") else a.result)
    md, png = write_report(result, f"{stem}.md", f"{stem}.png")
    print(md)
    print(f"wrote {stem}.md" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
