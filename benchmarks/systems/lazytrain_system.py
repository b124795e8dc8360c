"""lazytrain with a given policy (``milp`` or ``megatrain``).  On CUDA it is ``benchmarks/run_plan.py``'s
``run_one`` (compile, cap the GPU, warm-up + measured steps, one profiled step); the plan it compiles
is kept (by wrapping ``lazytrain.compile`` for the call) for the hardware FLOPs of its ops and the
predicted step time.  With ``--find-max-batch`` the batch is the compiler's largest feasible one
(``batch_size="max"``), then run to verify it.  With ``--device cpu`` it runs the same schedule in
the Trainer's CPU mode (fp32 parameters, torch AdamW), through the common measuring loop."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lazytrain
from lazytrain.measure import bench_worker as worker


def _hardware_flops(plan) -> float:
    """FLOPs of the plan's compute, recompute and backward ops (what the compiler sums for its
    predicted hardware TFLOPS)."""
    p = plan.predicted
    return p["hardware_tflops"] * 1e12 * p["step_time_s"]


def run(cfg: dict, opts: dict) -> dict:
    t0 = time.monotonic()
    cpu = cfg["device"] == "cpu"
    compile_kw = {"seq_len": cfg["seq"], "micro_batch": cfg["micro_batch"], "gpu_memory": cfg["gpu_memory"],
                  "hardware": cfg["hardware"], "policy": opts["policy"],
                  "optimizer": "adamw" if cpu else cfg["optimizer"],
                  "compile_blocks": compile_kw_blocks(cfg, opts)}
    if cpu:
        compile_kw["param_dtype"] = "float32"
    model = worker.build(cfg)
    if not cfg.get("max_batch_probe"):
        return _run_cpu(cfg, model, cfg["batch"], compile_kw) if cpu else _run_cuda(cfg, opts, model, cfg["batch"])
    # the batch search: the compiler's largest feasible batch under the host memory free here
    # (the process's model copy already counted), then one step of it if that fits the time left
    host = _host_free_bytes()
    t = time.perf_counter()
    limit = cfg.get("max_batch_limit", worker.MAX_BATCH_LIMIT)
    plan = lazytrain.compile(model, batch_size="max", max_batch_limit=limit, **compile_kw,
                             **({"host_memory": host} if host and not cpu else {}))
    info = {"batch": plan.batch_size, "max_batch": plan.batch_size, "max_batch_micro_batch": plan.micro_batch,
            "max_batch_compile_s": time.perf_counter() - t,
            "max_batch_predicted_step_s": plan.predicted["step_time_s"],
            "max_batch_host_budget_gib": host / worker.GiB if host else None}
    print(f"predicted largest batch: {plan.batch_size} (micro-batch {plan.micro_batch}, predicted step "
          f"{plan.predicted['step_time_s']:.1f} s)", flush=True)
    left = cfg.get("probe_deadline_s", float("inf")) - (time.monotonic() - t0)
    # setup (pinning the host store: ~25 s for qwen2.5-3b at batch 32 on the H200) and one step with
    # its first-step allocations
    if 1.5 * plan.predicted["step_time_s"] + 45 > left:
        print(f"not verified: one step would not fit the {left:.0f} s left", flush=True)
        return {**info, "max_batch_verified": False}
    row = (_run_cpu(cfg, model, plan.batch_size, compile_kw, plan=plan) if cpu
           else _run_cuda(cfg, opts, model, plan.batch_size, plan=plan))
    return {**row, **info, "max_batch_verified": True, "max_batch_step_s": row["median_step_s"],
            "max_batch_peak_gpu_gib": row["peak_gpu_bytes"] / worker.GiB}


def compile_kw_blocks(cfg: dict, opts: dict) -> bool:
    """Does this row run compiled block programs (its system's option, or ``--compile-blocks``)?"""
    return bool(opts.get("compile_blocks") or cfg.get("compile_blocks"))


def _host_free_bytes() -> int | None:
    """``MemAvailable`` less a 10% margin (page cache, the allocator, the kernel), or None off Linux."""
    avail = worker.proc_meminfo_bytes("MemAvailable")
    return int(avail * 0.9) if avail else None


def _run_cpu(cfg: dict, model, batch: int, compile_kw: dict, plan=None) -> dict:
    plan = plan or lazytrain.compile(model, batch_size=batch, **compile_kw)
    trainer = lazytrain.Trainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=cfg["lr"], max_grad_norm=1.0),
                                device="cpu")
    try:
        m = worker.measure(dict(cfg, batch=batch), lambda ids, labels: trainer.step((ids, labels)).loss,
                          worker.batches(dict(cfg, batch=batch), worker.vocab_size(model)))
    finally:
        trainer.close()
    return {**m, "batch": batch, "params": worker.n_params(model), "hardware_flops": _hardware_flops(plan),
            "predicted_step_s": plan.predicted["step_time_s"], "micro_batch": plan.micro_batch,
            "plan_params": plan.graph.total_params, "optimizer": "lazytrain TorchAdamW (CPU)"}


def _run_cuda(cfg: dict, opts: dict, model, batch: int, plan=None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from run_plan import parser, run_one

    args = parser().parse_args([])          # run_plan's defaults for whatever the bench does not set
    vars(args).update(model=cfg["model"], batch=batch, seq=cfg["seq"], micro_batch=cfg["micro_batch"],
                      gpu_memory=cfg["gpu_memory"], hardware=cfg["hardware"], policy=opts["policy"],
                      optimizer=cfg["optimizer"], lr=cfg["lr"], steps=cfg["steps"], warmup=cfg["warmup"],
                      profile=cfg.get("profile", True), compile_blocks=compile_kw_blocks(cfg, opts))
    plans = [plan] if plan is not None else []
    real_compile = lazytrain.compile

    def keep(*a, **kw):
        plans.append(real_compile(*a, **kw))
        return plans[-1]

    lazytrain.compile = keep                 # run_one calls lazytrain.compile(...): keep its plan
    try:
        out = run_one(args, model, 0.0, plan=plan)
    finally:
        lazytrain.compile = real_compile
    params = worker.n_params(model)
    return {"batch": batch, "params": params, "median_step_s": out["median_step_s"],
            "step_s": out["step_s"], "losses": out["losses"],
            "peak_gpu_bytes": out["measured_peak_gpu_gib"] * worker.GiB,
            "hardware_flops": _hardware_flops(plans[-1]), "predicted_step_s": out["predicted_step_s"],
            "predicted_peak_gpu_gib": out["predicted_peak_gpu_gib"], "micro_batch": out["micro_batch"],
            "plan_params": out["total_params"],
            "optimizer": f"lazytrain {cfg['optimizer']} (host" + (f"; GPU for {len(out['resident'])} resident blocks)"
                                                                 if out.get("resident") else ")"),
            "resident_blocks": out.get("resident"), "hidden": out.get("hidden"),
            "exposed_update_s": out.get("exposed_update_s"), "update_s": out.get("update_s"),
            "device_update_s": out.get("device_update_s"), "busy_s": out.get("busy_s"), "compile_s": out["compile_s"],
            "setup_s": out["setup_s"], "compile_blocks": out["compile_blocks"], "block_compile": out["block_compile"]}
