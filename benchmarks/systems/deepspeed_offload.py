"""DeepSpeed ZeRO with CPU offload, the peer most users would pick: ``opts["stage"]`` 3 keeps the parameters
and the optimizer on the CPU (ZeRO-3 ``offload_param`` + ``offload_optimizer``), 2 the optimizer only (the
bf16 parameters stay on the GPU).  bf16 (fp32 master weights in the CPU optimizer, DeepSpeedCPUAdam in
AdamW mode, no weight decay), Hugging Face gradient checkpointing (non-reentrant; our GPT: each decoder
layer checkpointed as the other baselines do), gradient clipping at 1.0, the whole batch as one micro-batch.
One process, world size 1, on the bench's model, tokens and GPU cap (``bench_worker``).

DeepSpeed is not a dependency of LazyTrain: where it is not installed, or where there is no GPU (its
offload engine and CPU Adam need CUDA), the row says so and the bench goes on.  Written for DeepSpeed
0.19.8 (config keys as its ``config-json`` documentation names them).
"""

from __future__ import annotations

import importlib.util
import os
import socket

import torch

from lazytrain.measure import bench_worker as worker

#: what the stage offloads, for the row
OFFLOADS = {3: "parameters and optimizer on the CPU", 2: "optimizer on the CPU"}


def require_deepspeed(cfg: dict):
    """The ``deepspeed`` module, or an error that says what is missing (a row, not a crash)."""
    if cfg["device"] != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("deepspeed needs CUDA: its ZeRO offload and CPU Adam run beside a GPU "
                           "(run the bench with --device cuda on a GPU machine)")
    if importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError("deepspeed is not installed: pip install deepspeed==0.19.8 (its CPU Adam builds "
                           "with the machine's nvcc on first use)")
    import deepspeed
    return deepspeed


def ds_config(cfg: dict, stage: int) -> dict:
    """The DeepSpeed config of one row: ZeRO ``stage`` with CPU offload, bf16, clipping at 1.0, AdamW."""
    if stage not in OFFLOADS:
        raise ValueError(f"deepspeed offload rows are ZeRO stage 2 or 3, got {stage!r}")
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": cfg["batch"], "train_micro_batch_size_per_gpu": cfg["batch"],
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": zero, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


def _one_process_group() -> None:
    """The environment ``deepspeed.initialize`` reads to start a world of one (rank 0, a free local port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)


def _checkpointing(model) -> None:
    """Hugging Face's own gradient checkpointing where the model has it, else each decoder layer wrapped."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        worker.checkpoint_layers(model)


def run(cfg: dict, opts: dict) -> dict:
    deepspeed = require_deepspeed(cfg)
    stage = opts["stage"]
    config = ds_config(cfg, stage)
    torch.cuda.set_device(0)
    worker.cap_gpu(cfg)
    _one_process_group()
    model = worker.build(cfg)
    vocab, params = worker.vocab_size(model), worker.n_params(model)
    _checkpointing(model)
    model.train()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)

    def step(ids, labels):
        loss = worker.loss_of(engine, ids.to(engine.device), labels.to(engine.device))
        engine.backward(loss)
        engine.step()                   # clip, CPU Adam, zero the gradients
        return loss.detach()
    try:
        m = worker.measure(cfg, step, worker.batches(cfg, vocab))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {**m, "batch": cfg["batch"], "params": params, "hardware_flops": 8 * params * cfg["batch"] * cfg["seq"],
            "checkpointing": True, "optimizer": "DeepSpeedCPUAdam (AdamW mode, CPU)", "zero_stage": stage,
            "offload": OFFLOADS[stage], "deepspeed": deepspeed.__version__}
