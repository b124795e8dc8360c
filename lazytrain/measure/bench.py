"""``lazytrain bench``: one command, one subprocess per system, the same model, batch, seq and GPU cap.

    lazytrain bench --model qwen2.5-3b --batch 8 --seq 1024 --gpu-memory 24GiB      # or benchmarks/bench.py

Systems (``--systems``, comma-separated; the modules are ``benchmarks/systems/*.py``):

    lazytrain-milp       lazytrain, MILP plan (reuses benchmarks/run_plan.py's run_one on CUDA)
    lazytrain-megatrain  lazytrain, megatrain policy
    lazytrain-milp-compiled  lazytrain, MILP plan, block programs compiled by Inductor (not in the default set)
    fsdp2                FSDP2 fully_shard + CPUOffloadPolicy + per-layer activation checkpointing, fused CPU AdamW
    plain                plain PyTorch on the GPU: fp32 master + bf16 autocast, fused AdamW
    plain-ckpt           the same with per-layer activation checkpointing (not in the default set)
    deepspeed-zero3-offload  DeepSpeed ZeRO-3, parameters and optimizer on the CPU (DeepSpeedCPUAdam), HF
                         gradient checkpointing, bf16 (not in the default set: deepspeed is not a dependency;
                         where it is missing, or there is no GPU, the row says so)
    deepspeed-zero2-offload  the same with ZeRO-2: optimizer on the CPU, bf16 parameters on the GPU

Uncapped rows (as the reference table's DeepSpeed figures were measured): ``--gpu-memory`` at or above the
GPU's memory (e.g. ``141GiB`` on an H200) sets the per-process fraction to 1.

Each system runs in its own process (``python -m lazytrain.measure.bench_worker ...``), so peak GPU memory
and host RSS are per system and an out-of-memory (GPU or host) in one is a row with an error, not a
crash.  Every process builds the model the same way (``torch.manual_seed(0)`` then ``random_model`` on
the CPU, bf16 on CUDA / fp32 with ``--device cpu``), trains on the same seeded random tokens
(``torch.Generator().manual_seed(1)``, one ``randint`` batch per step, as ``run_plan.py`` does), runs
``--warmup`` then ``--steps`` measured steps, and is accounted the same way (``bench_worker.finish_row``):

- step s: median of the measured steps (wall clock, device synchronised);
- model TFLOPS: ``6 * params * batch * seq / step s`` (params counted once, tied weights once);
- hardware TFLOPS, counting recompute: lazytrain from the plan's op FLOPs (forward + recompute +
  backward of every block, attention included); checkpointing baselines ``8 * params * tokens``,
  ``plain`` ``6 * params * tokens``;
- peak GPU GiB: ``torch.cuda.max_memory_allocated`` over the measured steps (reset after warm-up);
- host RSS GiB: the process's peak (``VmHWM`` in ``/proc/self/status``), model build included.

Time budget: ``--budget-s`` (default 540 s, to fit in 9 minutes) is shared out as the run goes:
each system may take its share of the budget left among the systems left (``WEIGHT``: lazytrain's
rows also compile and pin memory), or ``--timeout-s``, so time a fast system leaves over goes to
the next ones.  ``--device cpu`` is a debug mode (fp32 everywhere, no cap) for tests.

``--find-max-batch`` adds a second phase after every system's row at ``--batch`` (which keeps the
whole budget's first ``MAIN_SHARE``): the largest batch that fits the cap, per system, each try one
step without warm-up (fitting is the question, not speed).  lazytrain compiles with
``batch_size="max"`` under the host memory this machine has free, at the micro-batch its row at
``--batch`` ran (unless ``--micro-batch``), and verifies the predicted largest batch with one step
when that fits the time left, else reports it as predicted only.  Baselines double from the batch
that fitted in the first phase (halving from ``--batch`` when it did not) until a try runs out of
memory, then bisect; a batch known not to fit is never retried.  The result is the row's
``max_batch`` (with ``max_batch_tries``).

Results: ``<out-dir>/<name>.json`` (format ``lazytrain.bench/1``), ``.md`` (table with the exact
command, date and machine) and ``.png`` (model TFLOPS per system), rendered by
``benchmarks/report.py``; per-system logs in ``<out-dir>/<name>.logs/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..frontend.lora import parse_lora
from .bench_worker import BENCH_DIR, MAX_BATCH_LIMIT, SYSTEMS, GiB, load_bench_module, proc_meminfo_bytes

FORMAT = "lazytrain.bench/1"
DEFAULT_SYSTEMS = ("lazytrain-milp", "lazytrain-megatrain", "fsdp2", "plain")
#: with --find-max-batch, the share of the budget the rows at --batch may use (the rest: batch search)
MAIN_SHARE = 0.5
#: a system's share of the time left, relative to the others still to run: lazytrain also traces,
#: solves and pins its host store, DeepSpeed pins its offload buffers (and builds its CPU Adam on first
#: use), where a baseline only builds the model; lazytrain with compiled blocks also runs Inductor on them
WEIGHT = {"lazytrain-milp": 2.0, "lazytrain-megatrain": 1.5, "lazytrain-milp-compiled": 2.5,
          "deepspeed-zero3-offload": 1.5, "deepspeed-zero2-offload": 1.5}
#: the same in the batch search, where lazytrain compiles a plan of hundreds of sequences and runs it
MAX_WEIGHT = {"lazytrain-milp": 4.0, "lazytrain-megatrain": 4.0, "lazytrain-milp-compiled": 4.0}


# ---- arguments -------------------------------------------------------------------------------------
def lora(text: str) -> dict | None:
    """``--lora``'s value (``frontend/lora.py``) as its mapping, which the workers receive as JSON."""
    try:
        spec = parse_lora(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if spec is None else spec.to_json()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-3b", help="preset, HF config.json or pkg.module:factory "
                                                         "(default qwen2.5-3b)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument("--gpu-memory", default="24GiB", help="GPU cap for every system (default 24GiB)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up (default 3, at least 3)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--optimizer", default="hybrid8bit", choices=["hybrid8bit", "adamw"],
                   help="lazytrain's host optimizer (baselines use torch's fused AdamW)")
    p.add_argument("--hardware", default="h200",
                   help="lazytrain hardware profile (default h200; cpu with --device cpu)")
    p.add_argument("--micro-batch", type=int, default=None, help="lazytrain micro-batch (default: chosen)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: debug mode (fp32, no cap)")
    p.add_argument("--budget-s", type=float, default=540.0, help="time for the whole run (default 540)")
    p.add_argument("--timeout-s", type=float, default=None, help="fixed per-system (per-try) timeout instead")
    p.add_argument("--find-max-batch", action="store_true", help="also find the largest batch that fits the cap")
    p.add_argument("--max-batch-limit", type=int, default=MAX_BATCH_LIMIT,
                   help=f"the batch search stops here (default {MAX_BATCH_LIMIT}; on the CPU, without a cap, "
                        "only this stops it)")
    p.add_argument("--compile-blocks", action="store_true",
                   help="every lazytrain row runs Inductor-compiled block programs (the lazytrain-milp-compiled "
                        "system does for its row alone)")
    p.add_argument("--lora", type=lora, default=None, metavar="r=R,alpha=A,targets=M,..",
                   help="every system trains LoRA adapters (PEFT) on the model instead of all of it (the same spec "
                        "as lazytrain train --lora)")
    p.add_argument("--out-dir", default=str(BENCH_DIR / "results"), help="default benchmarks/results")
    p.add_argument("--name", default=None, help="file stem (default bench_<model>_b<batch>_s<seq>_<gpu cap>)")


def config_from_args(a) -> dict:
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if a.max_batch_limit < 1:
        raise ValueError(f"--max-batch-limit must be positive, got {a.max_batch_limit}")
    if a.steps < 3:
        raise ValueError(f"--steps must be at least 3 (the median of 3 steps or more), got {a.steps}")
    hardware = "cpu" if a.device == "cpu" and a.hardware == "h200" else a.hardware
    return {"model": a.model, "batch": a.batch, "seq": a.seq, "gpu_memory": a.gpu_memory, "systems": systems,
            "steps": a.steps, "warmup": a.warmup, "lr": a.lr, "optimizer": a.optimizer, "hardware": hardware,
            "micro_batch": a.micro_batch, "device": a.device, "budget_s": a.budget_s, "timeout_s": a.timeout_s,
            "find_max_batch": a.find_max_batch, "max_batch_limit": a.max_batch_limit, "out_dir": a.out_dir,
            "name": a.name, "compile_blocks": a.compile_blocks, "lora": a.lora}


def command_line(cfg: dict) -> str:
    """The ``lazytrain bench`` command that repeats this run, every setting spelled out."""
    args = ["lazytrain", "bench", "--model", cfg["model"], "--batch", cfg["batch"], "--seq", cfg["seq"],
            "--gpu-memory", cfg["gpu_memory"], "--systems", ",".join(cfg["systems"]), "--steps", cfg["steps"],
            "--warmup", cfg["warmup"], "--lr", cfg["lr"], "--optimizer", cfg["optimizer"], "--hardware",
            cfg["hardware"], "--device", cfg["device"], "--budget-s", cfg["budget_s"]]
    for flag, key in (("--micro-batch", "micro_batch"), ("--timeout-s", "timeout_s")):
        if cfg[key] is not None:
            args += [flag, cfg[key]]
    if cfg["find_max_batch"]:
        args += ["--find-max-batch", "--max-batch-limit", cfg.get("max_batch_limit", MAX_BATCH_LIMIT)]
    if cfg.get("compile_blocks"):
        args.append("--compile-blocks")
    if cfg.get("lora"):
        args += ["--lora", str(parse_lora(cfg["lora"]))]
    return shlex.join(map(str, args))


def main(argv: list[str] | None = None, prog: str = "lazytrain bench") -> dict:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(config_from_args(ap.parse_args(argv)))


# ---- the driver --------------------------------------------------------------------------------------
def run(cfg: dict) -> dict:
    """Run every system in its own process; write JSON, markdown and PNG; return the result dict."""
    out_dir = Path(cfg["out_dir"])
    name = cfg["name"] or f"bench_{_model_tag(cfg['model'])}_b{cfg['batch']}_s{cfg['seq']}_{cfg['gpu_memory']}"
    logs = out_dir / f"{name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    systems = cfg["systems"]
    start = time.monotonic()
    deadline = start + cfg["budget_s"] * (MAIN_SHARE if cfg["find_max_batch"] else 1.0)
    print(f"bench: {', '.join(systems)} on {cfg['model']} batch {cfg['batch']} seq {cfg['seq']} cap "
          f"{cfg['gpu_memory']} ({cfg['device']}); budget {cfg['budget_s']:.0f} s"
          + (f", {cfg['timeout_s']:.0f} s per system" if cfg["timeout_s"] else
             f", about {(deadline - start) / len(systems):.0f} s per system (unused time carries over)")
          + (", then the largest batch per system in the time left" if cfg["find_max_batch"] else ""), flush=True)
    rows = []
    for i, system in enumerate(systems):
        timeout = cfg["timeout_s"] or _share(systems[i:], deadline)
        print(f"[{i + 1}/{len(systems)}] {system}: up to {timeout:.0f} s", flush=True)
        t = time.monotonic()
        row = run_system(system, cfg, timeout, logs / f"{system}.log")
        row["wall_s"] = round(time.monotonic() - t, 1)
        rows.append(row)
        print(f"    {_brief(row)}", flush=True)
    if cfg["find_max_batch"]:
        deadline = start + cfg["budget_s"]
        for i, (system, row) in enumerate(zip(systems, rows)):
            timeout = cfg["timeout_s"] or _share(systems[i:], deadline, MAX_WEIGHT)
            print(f"[max batch {i + 1}/{len(systems)}] {system}: up to {timeout:.0f} s", flush=True)
            t = time.monotonic()
            row.update(_max_batch(system, cfg, row, timeout, logs))
            row["max_batch_wall_s"] = round(time.monotonic() - t, 1)
            print(f"    largest batch: {row.get('max_batch')}"
                  + (" (predicted, not run)" if row.get("max_batch_verified") is False else ""), flush=True)
    result = {"format": FORMAT, "command": command_line(cfg), "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "machine": machine(rows), "config": {k: v for k, v in cfg.items() if k != "name"},
        "rows": rows}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    report = load_bench_module("report")
    md, png = report.write_report(result, out_dir / f"{name}.md", out_dir / f"{name}.png")
    print(md)
    print(f"wrote {path}, {out_dir / f'{name}.md'}" + (f", {png}" if png else ""))
    return result


def _model_tag(model: str) -> str:
    """The model's part of a result's file name: a preset as it is ("qwen2.5-3b"), a config file by
    its folder or name ("Qwen2-7B" for ``.../Qwen2-7B/config.json``), a factory by its function."""
    p = Path(model)
    if p.suffix == ".json":
        p = p.parent if p.stem == "config" and p.parent.name else p.with_suffix("")
    tag = p.name or model
    return "".join(c if c.isalnum() or c in ".-_" else "_" for c in tag.rsplit(":", 1)[-1])


def _share(left: list[str], deadline: float, weight: dict = WEIGHT) -> float:
    """Seconds for ``left[0]``: its weighted share of the time to ``deadline`` (what an earlier system
    did not use carries over)."""
    w = [weight.get(s, 1.0) for s in left]
    return max(1.0, (deadline - time.monotonic()) * w[0] / sum(w))


def _brief(row: dict) -> str:
    if row.get("error"):
        return f"error: {row['error']}"
    return (f"batch {row['batch']}: {row['median_step_s']:.3f} s/step, {row['model_tflops']:.1f} model TFLOPS, "
            f"peak GPU {row['peak_gpu_gib']:.2f} GiB, host RSS {row['host_rss_gib']:.2f} GiB")


def run_system(system: str, cfg: dict, timeout: float, log: Path, batch: int | None = None, **overrides) -> dict:
    """One worker process; a timeout, a crash or a missing result becomes a row with an error.
    ``overrides`` change the worker's config (the batch search's one-step tries)."""
    cfg = dict(cfg, batch=batch or cfg["batch"], **overrides)
    base = {"system": system, "batch": cfg["batch"]}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "row.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                         os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "lazytrain.measure.bench_worker", system, str(cfg_path), str(out_path)]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)        # the worker and anything it started (its own session)
                proc.wait()
                if not out_path.exists():        # the worker writes it whole (rename) or not at all
                    return {**base, "error": f"timed out after {timeout:.0f} s"}
                # the result was written, only the process's exit (freeing ~100 GiB of pinned memory
                # after a large batch) overran: keep the result
                base["note"] = f"killed while exiting after {timeout:.0f} s"
        if out_path.exists():
            return {**json.loads(out_path.read_text()), **({"note": base["note"]} if "note" in base else {})}
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
    why = "killed (host out of memory?)" if rc in (-9, 137) else f"exit code {rc}"
    return {**base, "error": f"{why}: {tail[0][:300]}"}


#: a batch-search try: one step, no warm-up, no profiled step
PROBE = {"steps": 1, "warmup": 0, "profile": False}


def _max_batch(system: str, cfg: dict, row: dict, timeout: float, logs: Path) -> dict:
    """The largest batch that fits ``system`` under the cap: fields to add to its row."""
    if system.startswith("lazytrain"):
        # multiples of the micro-batch its row ran (unless --micro-batch): a batch search at micro-batch
        # 1 builds plans of hundreds of micro-batches, too slow for the bench's time, and runs slowly
        mb = cfg["micro_batch"] or row.get("micro_batch")
        probe = run_system(system, cfg, timeout, logs / f"{system}_max.log", max_batch_probe=True,
                           probe_deadline_s=timeout, micro_batch=mb, **PROBE)
        if probe.get("error"):
            return {"max_batch": None, "max_batch_error": probe["error"]}
        keys = ("max_batch", "max_batch_micro_batch", "max_batch_compile_s", "max_batch_verified",
                "max_batch_predicted_step_s", "max_batch_step_s", "max_batch_peak_gpu_gib")
        return {k: probe[k] for k in keys if k in probe}
    fitted = not row.get("error")
    return _max_batch_by_doubling(system, cfg, row["batch"] if fitted else None, timeout, logs)


def _max_batch_by_doubling(system: str, cfg: dict, fits: int | None, timeout: float, logs: Path) -> dict:
    """Double from ``fits`` (a batch known to fit) until a try runs out of memory, or halve from
    ``--batch`` (known not to fit) until one fits; then bisect between the two while time is left.
    A batch at or above one that ran out of memory, or at or below one that fitted, is never tried."""
    deadline = time.monotonic() + timeout
    limit = cfg.get("max_batch_limit", MAX_BATCH_LIMIT)
    best, too_big, tries = fits, None if fits else cfg["batch"], []
    b = min(fits * 2, limit) if fits else cfg["batch"] // 2
    while time.monotonic() < deadline and b >= 1 and (too_big is None or b < too_big) and (best is None or b > best):
        row = run_system(system, cfg, deadline - time.monotonic(), logs / f"{system}_b{b}.log", batch=b, **PROBE)
        tries.append({"batch": b, "error": row.get("error")})
        if not row.get("error"):
            best = b
            b = min(b * 2, limit) if too_big is None else (b + too_big) // 2
        elif "out of memory" in row["error"]:
            too_big = b
            b = b // 2 if best is None else (best + b) // 2
        else:
            break                              # a timeout or a crash: no answer from this try
    out = {"max_batch": best, "max_batch_tries": tries, "max_batch_too_big": too_big}
    last = tries[-1]["error"] if tries else "no time for a try"
    if best is None:
        out["max_batch_note"] = ("no batch fitted" if last and "out of memory" in last else
                                 f"no answer: {last}" + (f" at batch {tries[-1]['batch']}" if tries else ""))
    elif too_big is None:
        out["max_batch_note"] = ("the search's limit (--max-batch-limit)" if best >= limit else
                                 "a lower bound: time ran out before a try ran out of memory")
    return out


def machine(rows: list[dict]) -> dict:
    gpu = next((r["gpu_name"] for r in rows if r.get("gpu_name")), None)
    if gpu is None:
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            gpu = "none"
    ram = proc_meminfo_bytes("MemTotal")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"gpu": gpu, "cpu": cpu, "cpu_cores": os.cpu_count(), "host_ram_gib": round(ram / GiB, 1),
            "hostname": platform.node(), "python": platform.python_version()}


if __name__ == "__main__":
    main(prog="python -m lazytrain.measure.bench")
