"""Plain PyTorch on the GPU: the whole model there, fp32 master weights, bf16 autocast, fused AdamW
(torch.optim.AdamW(fused=True)), gradient clipping at 1.0 as lazytrain does; ``checkpointing`` wraps
each decoder layer in activation checkpointing.  An out-of-memory error propagates to the worker,
which reports it as the row's result.  With ``--device cpu`` it runs in fp32 without autocast (CPU
bf16 is slow and only a debug path)."""

from __future__ import annotations

import torch

from lazytrain.measure import bench_worker as worker


def run(cfg: dict, opts: dict) -> dict:
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
        worker.cap_gpu(cfg)
    model = worker.build(cfg)
    vocab, params = worker.vocab_size(model), worker.n_params(model)
    if opts["checkpointing"]:
        worker.checkpoint_layers(model)
    model = model.to(device=device, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    m = worker.measure(cfg, worker.eager_step(model, opt, device, autocast), worker.batches(cfg, vocab))
    factor = 8 if opts["checkpointing"] else 6          # checkpointing runs each forward twice
    return {**m, "batch": cfg["batch"], "params": params,
            "hardware_flops": factor * params * cfg["batch"] * cfg["seq"],
            "checkpointing": opts["checkpointing"], "optimizer": "torch AdamW fused (GPU)"}
