"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) with ``CPUOffloadPolicy``, activation
checkpointing on each decoder layer and torch's fused AdamW on the CPU (the sharded fp32 parameters,
their gradients and the optimizer state live in host memory; FSDP2 gathers each layer to the GPU in
bf16, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).  One process, world size 1,
its process group on a ``file://`` store: nccl on the GPU, gloo on the CPU (``--device cpu``: fp32,
unpinned).  Gradient clipping at 1.0, as lazytrain does."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from lazytrain.measure import bench_worker as worker


def run(cfg: dict, opts: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        worker.cap_gpu(cfg)
    fd, store = tempfile.mkstemp(prefix="fsdp2_store_")
    os.close(fd)
    os.unlink(store)                       # the file store wants a path that does not exist yet
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        model = worker.build(cfg)
        vocab, params = worker.vocab_size(model), worker.n_params(model)
        model = model.float().train()                  # fp32 master weights, sharded onto the host
        mesh = init_device_mesh("cuda" if cuda else "cpu", (1,))
        kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=cuda)}
        if cuda:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in worker.checkpoint_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], fused=True)   # on the CPU: fused CPU AdamW
        device = torch.device("cuda" if cuda else "cpu")

        m = worker.measure(cfg, worker.eager_step(model, opt, device), worker.batches(cfg, vocab))
    finally:
        dist.destroy_process_group()
    return {**m, "batch": cfg["batch"], "params": params, "hardware_flops": 8 * params * cfg["batch"] * cfg["seq"],
            "checkpointing": True, "optimizer": "torch AdamW fused (CPU)"}
