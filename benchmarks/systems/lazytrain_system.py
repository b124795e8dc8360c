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
from types import SimpleNamespace

import lazytrain
from lazytrain import bench


def _hardware_flops(plan) -> float:
    """FLOPs of the plan's compute, recompute and backward ops (what the compiler sums for its
    predicted hardware TFLOPS)."""
    p = plan.predicted
    return p["hardware_tflops"] * 1e12 * p["step_time_s"]


def run(cfg: dict, opts: dict) -> dict:
    cpu = cfg["device"] == "cpu"
    compile_kw = {"seq_len": cfg["seq"], "micro_batch": cfg["micro_batch"], "gpu_memory": cfg["gpu_memory"],
                  "hardware": cfg["hardware"], "policy": opts["policy"],
                  "optimizer": "adamw" if cpu else cfg["optimizer"]}
    if cpu:
        compile_kw["param_dtype"] = "float32"
    model = bench.build(cfg)
    extra = {}
    batch = cfg["batch"]
    if cfg["find_max_batch"]:
        t = time.perf_counter()
        plan = lazytrain.compile(model, batch_size="max", **compile_kw)
        batch = plan.batch_size
        extra = {"max_batch": batch, "max_batch_predicted": True, "max_batch_compile_s": time.perf_counter() - t,
                 "max_batch_micro_batch": plan.micro_batch}
        print(f"predicted largest batch: {batch} (micro-batch {plan.micro_batch}); verifying with a run", flush=True)
    if cpu:
        return {**_run_cpu(cfg, model, batch, compile_kw), **extra}
    return {**_run_cuda(cfg, opts, model, batch), **extra}


def _run_cpu(cfg: dict, model, batch: int, compile_kw: dict) -> dict:
    plan = lazytrain.compile(model, batch_size=batch, **compile_kw)
    trainer = lazytrain.Trainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=cfg["lr"], max_grad_norm=1.0),
                                device="cpu")
    try:
        m = bench.measure(dict(cfg, batch=batch), lambda ids, labels: trainer.step((ids, labels)).loss,
                          bench.batches(dict(cfg, batch=batch), bench.vocab_size(model)))
    finally:
        trainer.close()
    return {**m, "batch": batch, "params": bench.n_params(model), "hardware_flops": _hardware_flops(plan),
            "predicted_step_s": plan.predicted["step_time_s"], "micro_batch": plan.micro_batch,
            "plan_params": plan.graph.total_params, "optimizer": "lazytrain TorchAdamW (CPU)"}


def _run_cuda(cfg: dict, opts: dict, model, batch: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from run_plan import run_one

    args = SimpleNamespace(model=cfg["model"], batch=batch, seq=cfg["seq"], micro_batch=cfg["micro_batch"],
                           gpu_memory=cfg["gpu_memory"], host_memory=None, hardware=cfg["hardware"],
                           policy=opts["policy"], optimizer=cfg["optimizer"], nvme_dir=None, lr=cfg["lr"],
                           steps=cfg["steps"], warmup=cfg["warmup"], optim_threads=None, artifacts=None)
    plans = []
    real_compile = lazytrain.compile

    def keep(*a, **kw):
        plans.append(real_compile(*a, **kw))
        return plans[-1]

    lazytrain.compile = keep                 # run_one calls lazytrain.compile(...): keep its plan
    try:
        out = run_one(args, model, 0.0)
    finally:
        lazytrain.compile = real_compile
    params = bench.n_params(model)
    return {"batch": batch, "params": params, "median_step_s": out["median_step_s"],
            "step_s": None, "losses": out["losses"], "peak_gpu_bytes": out["measured_peak_gpu_gib"] * bench.GiB,
            "hardware_flops": _hardware_flops(plans[-1]), "predicted_step_s": out["predicted_step_s"],
            "predicted_peak_gpu_gib": out["predicted_peak_gpu_gib"], "micro_batch": out["micro_batch"],
            "plan_params": out["total_params"], "optimizer": f"lazytrain {cfg['optimizer']} (CPU)",
            "hidden": out["hidden"], "exposed_update_s": out["exposed_update_s"], "compile_s": out["compile_s"],
            "setup_s": out["setup_s"]}
