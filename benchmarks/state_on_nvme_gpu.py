"""A model whose training state is larger than the host memory it is given, trained on the GPU with part of its
state on this machine's disk: the predicted step beside the measured one, and the host RSS beside its budget.

    python benchmarks/state_on_nvme_gpu.py --model qwen2.5-14b --batch 16 --seq 1024 --gpu-memory 24GiB \\
        --host-memory 64GiB --nvme-dir /tmp/lazytrain-state --nvme-memory 56GiB --steps 2 --warmup 1 -o OUT

In order: the disk at ``--nvme-dir`` measured as the NVMe tier moves data (``measure/disk.py``: read, write, both
at once, the runtime's requests); a hardware profile, the built-in one of this GPU (h100 or h200) with those disk
figures, written to ``OUT/hardware.json``; the plan compiled against the budgets (``OUT/plan.json``); the model
built on the meta device, its random weights computed a block at a time (``random_init``: the host never holds
the whole model, only the trainer's store); the GPU capped at ``--gpu-memory``; warm-up and measured steps on
random tokens.  ``OUT/result.json``: the predicted and measured steps, peak host RSS (``VmHWM``) and the budget,
the disk figures, where the state lived, the losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

import lazytrain
from lazytrain.compiler.budgets import BudgetError
from lazytrain.compiler.profiles import get_profile
from lazytrain.frontend.random_init import random_init
from lazytrain.ir import GiB
from lazytrain.measure.bench_worker import host_peak_rss_bytes
from lazytrain.measure.disk import disk_rates
from lazytrain.runtime.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.runtime.trainer import Trainer
from lazytrain.util.units import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--host-memory", default="64GiB",
                    help="host budgets to try in order, comma-separated: the first whose NVMe need fits the disk")
    ap.add_argument("--nvme-dir", required=True)
    ap.add_argument("--nvme-memory", default="56GiB")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--disk-bytes", default="2GiB", help="the size of the disk measurement's file")
    ap.add_argument("--profile", action="store_true", help="then one profiled step: the drive's in-step rates")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script (the cpu profile)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.nvme_dir).mkdir(parents=True, exist_ok=True)
    result: dict = {"args": vars(a)}

    def save() -> None:
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")

    t = time.perf_counter()
    disk = disk_rates(a.nvme_dir, parse_size(a.disk_bytes))
    result["disk"] = {**disk, "seconds": round(time.perf_counter() - t, 1)}
    print("disk", result["disk"], flush=True)
    cuda = a.device == "cuda"
    name = torch.cuda.get_device_name() if cuda else ""
    base = get_profile("cpu" if not cuda else "h200" if "H200" in name else "h100")
    hw = dataclasses.replace(base, name=f"{base.name}+disk", nvme_read_gbps=disk["nvme_read_gbps"],
                             nvme_write_gbps=disk["nvme_write_gbps"], nvme_both_gbps=disk["nvme_both_gbps"],
                             source=base.source + f"; disk measured at {a.nvme_dir} by benchmarks/state_on_nvme_gpu.py")
    hw.save(out / "hardware.json")
    save()

    t = time.perf_counter()
    free = shutil.disk_usage(a.nvme_dir).free
    nvme = min(parse_size(a.nvme_memory), int(0.9 * free))     # what this disk can hold
    plan, tried = None, []
    for host in a.host_memory.split(","):       # the first host budget whose state fits this machine's disk
        try:
            plan = lazytrain.compile(a.model, batch_size=a.batch, seq_len=a.seq, gpu_memory=a.gpu_memory,
                                     host_memory=host, nvme_dir=a.nvme_dir, nvme_memory=nvme,
                                     hardware=str(out / "hardware.json"))
            a.host_memory = host
            break
        except BudgetError as e:
            tried.append({"host_memory": host, "nvme_memory_gib": nvme / GiB, "error": str(e)})
            print("no plan:", host, e, flush=True)
    result["tried"], result["disk_free_gib"] = tried, free / GiB
    if plan is None:
        save()
        raise SystemExit("no host budget of --host-memory fits this disk")
    plan.save(out / "plan.json")
    result["host_budget_gib"] = parse_size(a.host_memory) / GiB
    pred = plan.predicted
    result["compile_s"] = round(time.perf_counter() - t, 1)
    result["predicted"] = {"step_s": pred["step_time_s"], "peak_host_gib": pred["peak_host_bytes"] / GiB,
                           "peak_nvme_gib": pred["peak_nvme_bytes"] / GiB, "peak_gpu_gib": pred["peak_gpu_bytes"] / GiB,
                           "busy_s": pred["busy_s"], "model_tflops": pred["model_tflops"]}
    result["nvme_state"] = {k: len(v) for k, v in plan.decisions.nvme_state.items()}
    result["decisions"] = {"policy": plan.decisions.policy, "micro_batch": plan.micro_batch}
    print("plan", result["predicted"], result["nvme_state"], flush=True)
    save()

    torch.manual_seed(0)
    model, weights = random_init(a.model, torch.bfloat16)
    if cuda:
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(a.gpu_memory) / torch.cuda.mem_get_info()[1]))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    trainer = Trainer(model, plan, optimizer=Hybrid8bitAdamW(lr=1e-5, max_grad_norm=1.0), device=a.device,
                      weights=weights, nvme_dir=a.nvme_dir, verbose=True)
    result["setup_s"] = round(time.perf_counter() - t, 1)
    result["rss_after_setup_gib"] = host_peak_rss_bytes() / GiB
    save()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g)
        sync()
        t = time.perf_counter()
        stats = trainer.step({"input_ids": ids, "labels": ids})
        sync()
        dt = time.perf_counter() - t
        losses.append(stats.loss)
        if i >= a.warmup:
            times.append(dt)
        rss = host_peak_rss_bytes() / GiB
        print(f"step {i}: {dt:.2f} s, loss {stats.loss:.4f}, peak RSS {rss:.2f} GiB", flush=True)
        result["measured"] = {"step_s": times, "losses": losses, "peak_rss_gib": rss,
                              "peak_gpu_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
                              "nvme_bytes_read": trainer.ctx.nvme.bytes_read,
                              "nvme_bytes_written": trainer.ctx.nvme.bytes_written}
        save()
    if times:
        med = statistics.median(times)
        result["measured"]["median_step_s"] = med
        result["predicted_over_measured"] = pred["step_time_s"] / med
    if a.profile:       # one more step, every op timed: the rates the drive reached inside the step
        trainer.profile = True
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g)
        trainer.step({"input_ids": ids, "labels": ids})
        prof = trainer.last_profile
        (out / "profile.json").write_text(json.dumps(prof.to_json(plan)) + "\n")
        ops = {op.id: op for op in plan.ops}
        moved: dict[str, list[float]] = {"state_read": [0.0, 0.0], "state_write": [0.0, 0.0]}
        for op_id, _res, start, end in prof.trace:
            kind = ops[op_id].kind.value
            if kind in moved:
                moved[kind][0] += ops[op_id].nbytes
                moved[kind][1] += end - start
        result["profiled"] = {"step_s": prof.step_s, "busy_s": prof.busy_s,
                              **{f"{k}_gbps": b / t / 1e9 for k, (b, t) in moved.items() if t}}
        print("profiled", result["profiled"], flush=True)
        save()
    result["state_files_gib"] = sum(f.stat().st_size for f in Path(trainer.ctx.nvme.root).glob("state_*")) / GiB
    trainer.close()
    save()
    print(json.dumps({k: result[k] for k in ("predicted", "measured", "host_budget_gib") if k in result}, indent=1))
    os._exit(0)


if __name__ == "__main__":
    main()
