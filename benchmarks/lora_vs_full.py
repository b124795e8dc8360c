"""Issue #44's GPU comparison: SmolLM2-135M-Instruct fine-tuned on the arithmetic chats with LoRA and fully, each
for the same wall time of training, exact match on the same held-out problems before and after.

    python -m lazytrain.data.arith_jsonl -o data/arith
    python benchmarks/lora_vs_full.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --data data/arith --minutes 2 \
        --out OUT

Each run is ``lazytrain train`` in its own process, with the same data, batch, packing, sequence and time limit;
the learning rate is each method's usual one for a model this size (full: 1e-4, the README's; LoRA: 1e-3, PEFT's
examples for small models, adapters on every linear layer, r=16, alpha=32).  ``OUT/<name>/metrics.json`` per run,
``OUT/summary.json`` the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"full": ["--lr", "1e-4"],
        "lora": ["--lr", "1e-3", "--lora", "r=16,alpha=32,targets=all-linear"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data", required=True, help="the folder of arith_jsonl's train.jsonl and eval.jsonl")
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--only", choices=sorted(RUNS), action="append")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in a.only or list(RUNS):
        folder = out / name
        cmd = [sys.executable, "-m", "lazytrain.app.cli", "train", "--model", a.gguf,
               "--data", str(Path(a.data) / "train.jsonl"), "--eval-data", str(Path(a.data) / "eval.jsonl"),
               "--pack", "--seq", str(a.seq), "--batch", str(a.batch), "--epochs", "50",
               "--time-limit-min", str(a.minutes), "--no-progress", "--no-export", "--output", str(folder),
               *RUNS[name]]
        print("$ " + " ".join(cmd[2:]), flush=True)
        with open(out / f"{name}.log", "w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if done.returncode:
            summary[name] = {"error": f"exit {done.returncode}; see {name}.log"}
            continue
        m = json.loads((folder / "metrics.json").read_text())
        summary[name] = {"command": " ".join(cmd[3:]), "exact_match_before": m["exact_match_before"],
                         "exact_match_after": m["exact_match"], "steps": m["steps_done"], "train_s": m["train_s"],
                         "wall_s": m["wall_s"], "peak_lr": m.get("peak_lr"), "params": m["params"],
                         "predicted_step_s": m["plan"]["predicted_step_s"],
                         "median_step_s": sorted(h["step_s"] for h in m["loss_curve"])[len(m["loss_curve"]) // 2],
                         "final_loss": m["loss_curve"][-1]["loss"], "eval_n": m["eval_curve"][-1]["n"],
                         "samples_after": m["eval_curve"][-1]["samples"][:3]}
        print(json.dumps({k: v for k, v in summary[name].items() if k != "samples_after"}), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
