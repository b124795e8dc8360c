"""QLoRA on the GPU (issue #44): a 7B-shaped Llama trained three ways at a GPU cap, each row its own process.

Rows: ``full`` (full fine-tune, Hybrid 8-bit AdamW), ``lora-bf16`` (LoRA r=16 on all linear layers, bf16 base) and
``lora-nf4`` (the same adapters on a 4-bit NF4 base: packed on the host, dequantized on the GPU before each block).
The model is Llama's 7B shape (hidden 4096, 32 layers, intermediate 11008, vocab 32000) with seeded random weights
(``frontend.random_init``: seconds, not Hugging Face's init), bf16.  Each row compiles a plan at ``--gpu-memory``
(``set_per_process_memory_fraction`` caps the process there too), trains ``--steps`` steps on seeded random tokens
and writes ``<out>/<row>.json``: the median step after ``--warmup`` warm-up steps, tokens/s, peak GPU memory
(``torch.cuda.max_memory_allocated``, from the first measured step), peak host RSS (VmHWM), the trainer's parameter
set-up seconds (quantizing the base included: ``Trainer.init_seconds``), the plan's predicted step and the losses;
``<out>/summary.md`` has the table.

    python benchmarks/qlora_gpu.py --out /tmp/qlora                      # on an H100/H200: three rows, ~15 min
    python benchmarks/qlora_gpu.py --quick --out /tmp/qlora              # 4 steps (1 warm-up), seq 512
    python benchmarks/qlora_gpu.py --tiny --out /tmp/qlora-tiny          # a 2-layer Llama on the CPU: tests the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

LLAMA_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
TINY = {**LLAMA_7B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 67, "max_position_embeddings": 128, "torch_dtype": "float32"}
LORA = "r=16,alpha=32,targets=all-linear"
#: row -> (LoRA spec or None, base bits)
ROWS = {"full": (None, 16), "lora-bf16": (LORA, 16), "lora-nf4": (LORA, 4)}
GiB = 1 << 30


def run_row(name: str, cfg: dict) -> dict:
    """Train one row in this process and return its figures (the worker's side)."""
    import statistics

    import torch

    import lazytrain
    from lazytrain.measure.bench_worker import batches, build, cap_gpu, host_peak_rss_bytes
    from lazytrain.runtime.optim import Hybrid8bitAdamW
    from lazytrain.runtime.trainer import Trainer
    lora, bits = ROWS[name]
    cuda = cfg["device"] == "cuda"
    if cuda:
        cap_gpu(cfg)
    t = time.perf_counter()
    model = build({"model": cfg["model"], "device": cfg["device"], "lora": lora})
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = lazytrain.compile(model, batch_size=cfg["batch"], seq_len=cfg["seq"], gpu_memory=cfg["gpu_memory"],
                             host_memory=cfg.get("host_memory"), base_bits=bits,
                             **({"hardware": "cpu", "param_dtype": "float32"} if not cuda else {}))
    compile_s = time.perf_counter() - t
    opt = Hybrid8bitAdamW(lr=1e-4, weight_decay=0.0, max_grad_norm=1.0,
                          num_threads=torch.get_num_threads() if not cuda else None)
    trainer = Trainer(model, plan, optimizer=opt, device=cfg["device"], verbose=False)
    data = batches(cfg, int(model.config.vocab_size))
    times, losses = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if cuda and i == cfg["warmup"]:
            torch.cuda.reset_peak_memory_stats()
        ids, labels = next(data)
        stats = trainer.step((ids, labels))
        print(f"{name} step {i}{' (warm-up)' if i < cfg['warmup'] else ''}: loss {stats.loss:.4f} "
              f"{stats.step_s:.3f} s", flush=True)
        if i >= cfg["warmup"]:
            times.append(stats.step_s)
            losses.append(stats.loss)
    trainer.close()
    step_s = statistics.median(times)
    g = plan.graph
    return {"row": name, "lora": lora, "base_bits": bits, "device": cfg["device"],
            "gpu_name": torch.cuda.get_device_name(0) if cuda else None, "batch": cfg["batch"], "seq": cfg["seq"],
            "gpu_memory": cfg["gpu_memory"], "micro_batch": plan.micro_batch, "steps": cfg["steps"],
            "warmup": cfg["warmup"], "median_step_s": step_s, "step_s": times,
            "tokens_per_s": cfg["batch"] * cfg["seq"] / step_s,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / GiB if cuda else 0.0,
            "host_rss_gib": host_peak_rss_bytes() / GiB, "param_setup_s": trainer.init_seconds,
            "build_s": build_s, "compile_s": compile_s, "predicted_step_s": plan.predicted["step_time_s"],
            "predicted_peak_gpu_gib": plan.predicted["peak_gpu_bytes"] / GiB,
            "trainable_params": g.trainable_params, "frozen_params": g.frozen_params,
            "host_frozen_gib": trainer.store.frozen_nbytes() / GiB, "losses": losses}


def worker(argv: list[str]) -> int:
    """``qlora_gpu.py --worker ROW CFG.json OUT.json``: one row; a failure is its row (with the error)."""
    name, cfg_path, out_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["model"] = str(Path(cfg_path).parent / cfg["model"])      # (run.json names it beside itself: no machine path)
    try:
        row = run_row(name, cfg)
    except Exception as e:  # noqa: BLE001 - a row that fails (out of memory) is reported, the others still run
        traceback.print_exc()
        from lazytrain.measure.bench_worker import host_peak_rss_bytes
        row = {"row": name, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}",
               "host_rss_gib": host_peak_rss_bytes() / GiB}
    tmp = Path(f"{out_path}.part")
    tmp.write_text(json.dumps(row, indent=1) + "\n")
    os.replace(tmp, out_path)
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| row | step (s) | tokens/s | peak GPU (GiB) | peak host RSS (GiB) | parameter set-up (s) "
             "| base on host (GiB) | predicted step (s) | micro-batch |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | {r.get('host_rss_gib', 0):.1f} | | | | |")
            continue
        lines.append(f"| {r['row']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['peak_gpu_gib']:.2f} "
                     f"| {r['host_rss_gib']:.1f} | {r['param_setup_s']:.1f} | {r['host_frozen_gib']:.2f} "
                     f"| {r['predicted_step_s']:.3f} | {r['micro_batch']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for <row>.json and summary.md")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--host-memory", default=None)
    ap.add_argument("--steps", type=int, default=6, help="measured steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 measured steps after 1 warm-up, seq 512")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer Llama (hidden 64) on the CPU, batch 2, seq 32")
    ap.add_argument("--timeout-s", type=int, default=1800, help="per row")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.quick:
        a.steps, a.warmup, a.seq = 3, 1, min(a.seq, 512)
    if a.tiny:
        a.batch, a.seq = 2, 32
    (out / "config.json").write_text(json.dumps(TINY if a.tiny else LLAMA_7B, indent=1) + "\n")
    cfg = {"model": "config.json", "device": "cpu" if a.tiny else "cuda", "batch": a.batch,
           "seq": a.seq, "gpu_memory": "8GiB" if a.tiny else a.gpu_memory, "host_memory": a.host_memory,
           "steps": a.steps, "warmup": a.warmup}
    (out / "run.json").write_text(json.dumps(cfg, indent=1) + "\n")
    rows = []
    for name in a.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}: one of {', '.join(ROWS)}")
        path = out / f"{name}.json"
        path.unlink(missing_ok=True)
        print(f"== {name}", flush=True)
        try:
            subprocess.run([sys.executable, __file__, "--worker", name, str(out / "run.json"), str(path)],
                           timeout=a.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            pass
        rows.append(json.loads(path.read_text()) if path.exists() else {"row": name, "error": "no result (timeout?)"})
    (out / "summary.md").write_text(table(rows))
    print(table(rows))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    main()
