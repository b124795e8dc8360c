"""lazytrain's loss curve overlaid on plain PyTorch training's: same model init, data, optimizer and schedule.

    python benchmarks/loss_overlay.py --model qwen2.5-0.5b --steps 300 --batch 32 --lr 3e-4 --out DIR \\
        [--device cuda|cpu] [--gpu-memory 24GiB] [--policy milp] [--time-limit-s 150]

Writes ``DIR/loss_overlay.json`` (``lazytrain.loss-overlay/1``) and ``DIR/loss_overlay.png`` and prints a
short table.  What is held equal, and how:

- *Model.* Built twice from the same seed with ``lazytrain.app.train.build_task_model`` (a preset, or
  ``--model task``: the task GPT of ``lazytrain train``), in fp32 on the CPU; the two initial state dicts
  are compared before training.
- *Data.* The arithmetic task's batches exactly as ``lazytrain train`` draws them (``train_batches``,
  seed 0, loss on the prompt too), drawn once and fed to both systems in the same order.
- *Optimizer.* AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), global gradient norm clipped to 1.0:
  lazytrain's ``TorchAdamW`` on the host, ``torch.optim.AdamW`` + ``clip_grad_norm_`` for plain PyTorch.
- *Schedule.* ``lazytrain.app.loop.lr_at``: linear warm-up over ``--warmup`` steps, then cosine to 0.1x,
  progress = step / ``--steps``, set as ``opt.lr`` before each ``trainer.step`` (as ``lazytrain train``
  does).  With clipping lazytrain's updates are lagged (step t's gradient is applied during step t + 1);
  the runtime applies it at the rate that was set when step t began, so the two schedules are the same.
- *Precision.* On CUDA lazytrain keeps bf16 parameters on the GPU and fp32 masters on the host; plain
  PyTorch keeps fp32 weights and runs under ``torch.autocast(bfloat16)``: the curves agree closely, not
  bit for bit.  On the CPU both are fp32 and agree to rounding.
- *Memory.* ``--gpu-memory`` caps lazytrain (compile budget and ``set_per_process_memory_fraction``);
  plain PyTorch gets the whole GPU unless ``--plain-gpu-memory`` caps it too.  Running out of memory
  is recorded as its result, and lazytrain's curve is still written.
- *Time.* ``--time-limit-s`` bounds each system: lazytrain runs first, then plain PyTorch for the
  steps lazytrain completed (or fewer, if its own limit comes first).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import lazytrain
from lazytrain.app.config import TrainConfig
from lazytrain.app.loop import lr_at
from lazytrain.app.session import hardware_for
from lazytrain.app.threads import cpu_threads
from lazytrain.app.train import build_task_model, logits_fn
from lazytrain.runtime.optim import TorchAdamW
from lazytrain.tasks import CharTokenizer, get_difficulty, shifted_cross_entropy, train_batches
from lazytrain.util.units import parse_size

FORMAT = "lazytrain.loss-overlay/1"
BETAS, EPS, MAX_GRAD_NORM = (0.9, 0.999), 1e-8, 1.0


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def _cap_gpu(dev: torch.device, size: str | None) -> None:
    """Cap this process's CUDA allocations at ``size`` (the whole GPU when None)."""
    if dev.type != "cuda":
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    frac = 1.0 if size is None else min(1.0, parse_size(size) / total)
    index = dev.index if dev.index is not None else torch.cuda.current_device()   # it wants an index
    torch.cuda.set_per_process_memory_fraction(frac, index)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)


def _peak(dev: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def run_lazytrain(a, model, batches, schedule, seq: int, dev: torch.device) -> dict:
    param_dtype = "bfloat16" if dev.type == "cuda" else "float32"
    hardware = a.hardware or hardware_for(dev)
    t = time.perf_counter()
    plan = lazytrain.compile(model, batch_size=a.batch, seq_len=seq, hardware=hardware,
                             gpu_memory=a.gpu_memory, host_memory=a.host_memory, policy=a.policy, optimizer="adamw",
                             param_dtype=param_dtype)
    compile_s = time.perf_counter() - t
    _cap_gpu(dev, a.gpu_memory)
    opt = TorchAdamW(lr=schedule(0), betas=BETAS, eps=EPS, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM)
    trainer = lazytrain.Trainer(model, plan, optimizer=opt, device=dev)
    curve, stop = [], "steps"
    t0 = time.perf_counter()
    try:
        for i, (ids, labels) in enumerate(batches):
            if a.time_limit_s is not None and time.perf_counter() - t0 >= a.time_limit_s:
                stop = "time limit"
                break
            opt.lr = schedule(i)
            s = trainer.step({"input_ids": ids, "labels": labels})
            curve.append({"step": i + 1, "loss": s.loss, "step_s": round(s.step_s, 4), "lr": schedule(i)})
    finally:
        trainer.close()
    out = {"curve": curve, "stop_reason": stop, "train_s": round(time.perf_counter() - t0, 2),
           "compile_s": round(compile_s, 2), "param_dtype": param_dtype, "gpu_cap": a.gpu_memory,
           "peak_gpu_gib": _gib(_peak(dev)),
           "plan": {"policy": plan.decisions.policy, "hardware": hardware,
                    "micro_batch": plan.micro_batch, "n_micro": plan.n_micro,
                    "predicted_step_s": plan.predicted.get("step_time_s"),
                    "predicted_peak_gpu_gib": _gib(plan.predicted.get("peak_gpu_bytes"))}}
    del trainer, opt
    gc.collect()
    return out


def run_plain(a, model, batches, schedule, dev: torch.device) -> dict:
    """Eager training: fp32 weights, bf16 autocast on CUDA, ``torch.optim.AdamW`` + ``clip_grad_norm_``."""
    _cap_gpu(dev, a.plain_gpu_memory)
    curve, stop, error = [], "steps", None
    t0 = time.perf_counter()
    try:
        model.to(dev).train()
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=schedule(0), betas=BETAS, eps=EPS, weight_decay=0.0)
        fwd = logits_fn(model, dev)
        t0 = time.perf_counter()
        for i, (ids, labels) in enumerate(batches):
            if a.time_limit_s is not None and time.perf_counter() - t0 >= a.time_limit_s:
                stop = "time limit"
                break
            ts = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = schedule(i)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = shifted_cross_entropy(fwd(ids), labels.to(dev))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()        # waits for the step
            curve.append({"step": i + 1, "loss": value, "step_s": round(time.perf_counter() - ts, 4),
                          "lr": schedule(i)})
    except torch.OutOfMemoryError as e:
        stop, error = "out of memory", f"OutOfMemoryError: {str(e).splitlines()[0]}"
        opt = loss = None                 # free what the failed step held
        model.zero_grad(set_to_none=True)
    out = {"curve": curve, "stop_reason": stop, "error": error, "train_s": round(time.perf_counter() - t0, 2),
           "param_dtype": "float32", "autocast": "bfloat16" if dev.type == "cuda" else None,
           "gpu_cap": a.plain_gpu_memory, "peak_gpu_gib": _gib(_peak(dev))}
    model.to("cpu")
    return out


def compare(lt: list[dict], pt: list[dict], tail: int = 50) -> dict:
    """Absolute loss differences over the steps both curves have."""
    d = [abs(x["loss"] - y["loss"]) for x, y in zip(lt, pt)]
    if not d:
        return {"steps_compared": 0, "max_abs_diff": None, "mean_abs_diff": None, "mean_abs_diff_last": None}
    last = d[-tail:]
    return {"steps_compared": len(d), "max_abs_diff": max(d), "mean_abs_diff": sum(d) / len(d),
            "mean_abs_diff_last": sum(last) / len(last), "last_n": len(last)}


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _table(res: dict) -> str:
    from tabulate import tabulate
    rows = []
    for name, r in (("lazytrain", res["lazytrain"]), ("plain PyTorch", res["plain"])):
        c = r["curve"]
        med = sorted(x["step_s"] for x in c)[len(c) // 2] if c else None
        rows.append([name, len(c), c[0]["loss"] if c else None, c[-1]["loss"] if c else None, med,
                     r["peak_gpu_gib"], (r.get("error") or r["stop_reason"])[:60]])
    return tabulate(rows, headers=["system", "steps", "first loss", "last loss", "median step s", "peak GPU GiB",
                                   "stopped by"], floatfmt=".4f")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a preset, or 'task' (lazytrain train's task GPT)")
    ap.add_argument("--model-override", default=None, metavar="JSON",
                    help="task-GPT config overrides, e.g. '{\"d_model\": 32}' (tests)")
    ap.add_argument("--difficulty", default=TrainConfig.difficulty)
    ap.add_argument("--seq", type=int, default=None, help="default: the difficulty's longest example")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    ap.add_argument("--gpu-memory", default=None, help="lazytrain's GPU budget and cap, e.g. 24GiB")
    ap.add_argument("--plain-gpu-memory", default=None, help="plain PyTorch's GPU cap (default: the whole GPU)")
    ap.add_argument("--host-memory", default=None)
    ap.add_argument("--hardware", default=None, help="hardware profile (default: matched to the device)")
    ap.add_argument("--policy", default="milp")
    ap.add_argument("--time-limit-s", type=float, default=None, help="training seconds per system")
    ap.add_argument("--threads", type=int, default=None, help="CPU mode: torch threads (default: idle cores)")
    ap.add_argument("--out", required=True, metavar="DIR")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.batch < 1:
        ap.error("--steps and --batch must be positive")

    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible to torch")
    if dev.type == "cpu":
        torch.set_num_threads(a.threads or cpu_threads())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = CharTokenizer()
    diff = get_difficulty(a.difficulty)
    seq = a.seq or diff.seq_len
    if seq < diff.seq_len:
        ap.error(f"--seq {seq} is shorter than the longest {diff.name!r} example ({diff.seq_len} tokens)")
    cfg = TrainConfig(model=a.model, difficulty=diff.name, batch=a.batch, seq=seq, steps=a.steps, lr=a.lr,
                      warmup=a.warmup, min_lr_ratio=a.min_lr_ratio, seed=a.seed, time_limit_min=None,
                      extra=json.loads(a.model_override) if a.model_override else {})

    def schedule(step: int) -> float:
        return lr_at(cfg, step, cfg.steps)

    t = time.perf_counter()
    models = [build_task_model(cfg, seq, tok.vocab_size)[0] for _ in range(2)]   # vocab and positions checked
    sds = [m.state_dict() for m in models]
    if sds[0].keys() != sds[1].keys() or not all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0]):
        raise SystemExit("the two builds from the same seed differ: the model's init is not deterministic")
    del sds
    build_s = time.perf_counter() - t
    n_params = sum(p.numel() for p in {id(p): p for p in models[0].parameters()}.values())
    stream = train_batches(a.batch, difficulty=diff, seed=a.seed, seq_len=seq, tokenizer=tok, loss_on_prompt=True)
    batches = [(b.input_ids, b.labels) for b, _ in zip(stream, range(a.steps))]
    print(f"{a.model}: {n_params / 1e6:.2f} M parameters, built twice in {build_s:.1f} s; {a.steps} steps of "
          f"{a.batch} x {seq} tokens ({diff.name}) on {_device_name(dev)}")

    res = {"format": FORMAT, "command": shlex.join(["python", "benchmarks/loss_overlay.py",
                                                    *(sys.argv[1:] if argv is None else argv)]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": dev.type,
           "device_name": _device_name(dev), "model": a.model, "params": n_params,
           "settings": {"difficulty": diff.name, "seq": seq, "batch": a.batch, "steps": a.steps, "lr": a.lr,
                        "warmup": a.warmup, "min_lr_ratio": a.min_lr_ratio, "seed": a.seed, "betas": list(BETAS),
                        "eps": EPS, "weight_decay": 0.0, "max_grad_norm": MAX_GRAD_NORM, "loss_on_prompt": True,
                        "policy": a.policy, "gpu_memory": a.gpu_memory, "plain_gpu_memory": a.plain_gpu_memory,
                        "time_limit_s": a.time_limit_s, "model_override": cfg.extra or None},
           "build_s": round(build_s, 2)}
    res["lazytrain"] = run_lazytrain(a, models[0], batches, schedule, seq, dev)
    done = len(res["lazytrain"]["curve"])
    res["plain"] = {"curve": [], "stop_reason": "not run yet", "error": None, "peak_gpu_gib": None}
    res["comparison"] = compare(res["lazytrain"]["curve"], [])
    _write(out, res, f"lazytrain ({a.policy})")      # lazytrain's curve survives whatever plain PyTorch does
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    res["plain"] = run_plain(a, models[1], batches[:done], schedule, dev)
    res["comparison"] = compare(res["lazytrain"]["curve"], res["plain"]["curve"])
    _write(out, res, f"lazytrain ({a.policy})")
    print(_table(res))
    c = res["comparison"]
    if c["steps_compared"]:
        print(f"|loss difference| over {c['steps_compared']} steps: max {c['max_abs_diff']:.4g}, "
              f"mean {c['mean_abs_diff']:.4g}, mean of the last {c['last_n']} {c['mean_abs_diff_last']:.4g}")
    print(f"wrote {out / 'loss_overlay.json'} and {out / 'loss_overlay.png'}")
    return res


def _write(out: Path, res: dict, label: str) -> None:
    from lazytrain.compiler.timeline import plot_loss
    tmp = out / "loss_overlay.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, out / "loss_overlay.json")
    s = res["settings"]
    plot_loss(out / "loss_overlay.png",
              {label: [(x["step"], x["loss"]) for x in res["lazytrain"]["curve"]],
               "plain PyTorch": [(x["step"], x["loss"]) for x in res["plain"]["curve"]]},
              title=f"{res['model']} on arithmetic ({s['difficulty']}), batch {s['batch']}, lr {s['lr']:g}, "
                    f"{res['device_name']}")


if __name__ == "__main__":
    main()
