"""What runs inside one system's process of ``lazytrain bench`` (``python -m lazytrain.measure.bench_worker
SYSTEM CFG.json OUT.json``): the model every system starts from, the seeded batches, the GPU cap, the
measuring loop, the accounting every row shares (``finish_row``) and the worker's entry point, which
turns any failure of the system into a row.  The driver (``lazytrain/measure/bench.py``) only schedules these
processes and reports; the systems (``benchmarks/systems/*.py``) import their helpers from here.

torch and LazyTrain's model code are imported inside the functions that use them: the driver imports
this module for its constants and stays a plain scheduler (torch loads, and CUDA starts, only in the
worker processes whose memory is measured).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from ..util.units import parse_size

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
#: system name -> (module in benchmarks/systems/, options passed to its ``run``)
SYSTEMS: dict[str, tuple[str, dict]] = {
    "lazytrain-milp": ("lazytrain_system", {"policy": "milp"}),
    "lazytrain-megatrain": ("lazytrain_system", {"policy": "megatrain"}),
    "lazytrain-milp-compiled": ("lazytrain_system", {"policy": "milp", "compile_blocks": True}),
    "fsdp2": ("fsdp2", {}),
    "plain": ("plain", {"checkpointing": False}),
    "plain-ckpt": ("plain", {"checkpointing": True}),
    "deepspeed-zero3-offload": ("deepspeed_offload", {"stage": 3}),
    "deepspeed-zero2-offload": ("deepspeed_offload", {"stage": 2}),
}
#: the batch search stops here unless --max-batch-limit says otherwise
MAX_BATCH_LIMIT = 4096
GiB = 1 << 30


def load_bench_module(name: str):
    """A module of ``benchmarks/`` (not installed with lazytrain) by its path, e.g. "report" or "systems/plain"."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: lazytrain bench runs from a clone of the repository "
                                f"(pip install -e .), where benchmarks/ sits next to lazytrain/")
    spec = importlib.util.spec_from_file_location(f"lazytrain_bench_{name.replace('/', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- helpers the systems share ------------------------------------------------
def build(cfg: dict):
    """The model every system starts from: seeded random weights (``random_model``: seconds, where
    Hugging Face's init of a 3B model took 164 s), on the CPU, bf16 (fp32 with --device cpu)."""
    import torch

    from ..frontend.random_init import random_model
    torch.manual_seed(0)
    model = random_model(cfg["model"], dtype=torch.float32 if cfg["device"] == "cpu" else torch.bfloat16)
    cfg_obj = getattr(model, "config", None)
    if hasattr(cfg_obj, "use_cache"):
        cfg_obj.use_cache = False          # HF: no KV cache while training
    if cfg.get("lora"):                    # every system trains the same adapters (``frontend/lora.py``)
        from ..frontend.lora import parse_lora, wrap
        model = wrap(model, parse_lora(cfg["lora"]))
    return model


def vocab_size(model) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", None) or getattr(cfg, "vocab", None) or 1000)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())      # parameters() counts a tied weight once


def batches(cfg: dict, vocab: int):
    """The same seeded random tokens for every system (as run_plan.py makes them): (ids, labels) pairs."""
    import torch
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=g)
        yield ids, ids.clone()


def cap_gpu(cfg: dict) -> None:
    """``set_per_process_memory_fraction`` to the ``--gpu-memory`` cap, as run_plan.py does."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(cfg["gpu_memory"]) / total))


def loss_of(model, ids, labels):
    out = model(ids, labels=labels)
    return out if hasattr(out, "backward") else out.loss


def eager_step(model, opt, device, autocast=None):
    """The baselines' training step: forward (under ``autocast`` if given), backward, clip at 1.0
    (the same clipping LazyTrain's rows use), optimizer step; returns the loss."""
    import torch

    def step(ids, labels):
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = loss_of(model, ids.to(device), labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def decoder_layers(model):
    """The model's decoder layers: its ``nn.ModuleList`` holding the most parameters."""
    from torch import nn
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder layers")
    return max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))


def checkpoint_layers(model):
    """Activation checkpointing on each decoder layer (``torch.utils.checkpoint``, non-reentrant): the
    layer's entry in its ModuleList is replaced by a wrapper; returns the wrappers."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:             # what the model reads off its layers (HF: attention_type)
                return getattr(self.inner, name)

    layers = decoder_layers(model)
    for i in range(len(layers)):
        layers[i] = Checkpointed(layers[i])
    return list(layers)


def measure(cfg: dict, step, data) -> dict:
    """``step(ids, labels) -> loss`` for warm-up + measured steps; timing and peak GPU memory."""
    import torch
    cuda = cfg["device"] == "cuda"
    times, losses = [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if cuda and i == cfg["warmup"]:
            torch.cuda.reset_peak_memory_stats()
        ids, labels = next(data)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = float(step(ids, labels))
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"step {i}{' (warm-up)' if i < cfg['warmup'] else ''}: loss {loss:.4f} {dt:.3f} s", flush=True)
        if i >= cfg["warmup"]:
            times.append(dt)
            losses.append(loss)
    return {"step_s": times, "median_step_s": statistics.median(times), "losses": losses,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0}


def host_peak_rss_bytes() -> int:
    return proc_status_bytes("VmHWM")


def host_rss_bytes() -> int:
    return proc_status_bytes("VmRSS")


def proc_meminfo_bytes(field: str) -> int:
    """A figure of /proc/meminfo in bytes (0 where there is none)."""
    return _proc_kib_field("/proc/meminfo", field)


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (0 where there is none)."""
    return _proc_kib_field("/proc/self/status", field)


def _proc_kib_field(path: str, field: str) -> int:
    """``field:  <n> kB`` of a /proc file, in bytes; 0 where the file or the field is missing."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def finish_row(system: str, cfg: dict, raw: dict) -> dict:
    """The figures every row has, computed the same way for every system from what it measured."""
    tokens = raw["batch"] * cfg["seq"]
    step_s = raw["median_step_s"]
    row = {"system": system, "model": cfg["model"], "batch": raw["batch"], "seq": cfg["seq"],
           "gpu_memory": cfg["gpu_memory"], "device": cfg["device"], "steps": cfg["steps"], "warmup": cfg["warmup"],
           "params": raw["params"], "median_step_s": step_s, "step_s": raw["step_s"],
           "model_tflops": 6 * raw["params"] * tokens / step_s / 1e12,
           "hardware_tflops": raw["hardware_flops"] / step_s / 1e12, "tokens_per_s": tokens / step_s,
           "peak_gpu_gib": raw["peak_gpu_bytes"] / GiB, "host_rss_gib": host_peak_rss_bytes() / GiB,
           "predicted_step_s": raw.get("predicted_step_s"), "losses": raw["losses"]}
    if row["predicted_step_s"]:
        row["predicted_over_measured"] = row["predicted_step_s"] / step_s
    return {**row, **{k: v for k, v in raw.items() if k not in row and k not in ("hardware_flops", "peak_gpu_bytes")}}


def worker_main(argv: list[str]) -> int:
    """``python -m lazytrain.measure.bench_worker SYSTEM CFG.json OUT.json``: run one system, write its row."""
    system, cfg_path, out_path = argv
    cfg = json.loads(Path(cfg_path).read_text())
    module, opts = SYSTEMS[system]
    base = {"system": system, "batch": cfg["batch"]}
    try:
        import torch
        if cfg["device"] == "cuda":
            base["gpu_name"] = torch.cuda.get_device_name(0)
        mod = load_bench_module(f"systems/{module}")
        raw = mod.run(cfg, dict(opts))
        # a batch-search answer that was not run (predicted only) has no measurement to finish
        row = {**base, **(finish_row(system, cfg, raw) if "median_step_s" in raw else raw)}
    except Exception as e:  # noqa: BLE001 - any failure of the system is its row, not a crash of the run
        traceback.print_exc()
        oom = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        row = {**base, "error": f"out of memory: {msg}" if oom else f"{type(e).__name__}: {msg}",
               "host_rss_gib": host_peak_rss_bytes() / GiB}
        try:
            import torch
            if cfg["device"] == "cuda":
                row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GiB
        except Exception:  # noqa: BLE001 - best effort only
            pass
    tmp = Path(f"{out_path}.part")
    tmp.write_text(json.dumps(row, indent=1))
    os.replace(tmp, out_path)                  # whole or absent, even if the driver kills this process
    return 0


if __name__ == "__main__":
    from lazytrain.measure.bench_worker import (
        worker_main as _worker,  # the package's module, not a second __main__ copy
    )
    sys.exit(_worker(sys.argv[1:]))
