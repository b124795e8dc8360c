"""Measure the collectives between this host's GPUs (``lazytrain profile`` when more than one is visible).

``measure_collectives(world_size, backend)`` starts ``world_size`` processes (one per GPU with NCCL; gloo
processes on the CPU, how the tests check this logic), joins them in a process group over a local TCP
store, and times on each, after a warm-up, the median of ``repeats`` of a ring ``all_gather`` and a
``reduce_scatter`` (the calls the runtime issues, ``runtime/distributed.py``) of gathered buffers of
several sizes.  Each time is the slowest rank's: a collective ends when its last rank does.

The figures fit the cost model's collective (``HardwareProfile.collective_seconds``): a gathered buffer
of n bytes over N ranks takes ``(N - 1) * (latency + n / N / bandwidth)``, linear in n.  A least-squares
line through every (n, seconds) of both kinds gives ``collective_latency_s`` = intercept / (N - 1) and
``collective_gbps`` = (N - 1) / N / slope (``fit``).  The sizes span small buffers, where the latency
dominates, to large ones, where the bandwidth does (1 MB to 256 MB of bf16 on GPUs: a 7B layer's gathered
parameters are 0.47 GB).  Between hosts (``internode_*``) stays modelled: one host cannot measure it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from ..util.local_processes import free_port, join_all

#: gathered buffer sizes (bytes) timed on GPUs, and on the CPU (gloo: the tests' small world)
GPU_SIZES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 4 << 20)
#: how long the processes may take to start, join and measure before the measurement is abandoned
START_TIMEOUT_S = 300.0


def fit(points: list[tuple[int, int, float]]) -> dict[str, float]:
    """``collective_gbps`` and ``collective_latency_s`` from ``(world_size, bytes gathered, seconds)``
    points of one world size (see the module docstring); a negative intercept (noise at small sizes)
    counts as zero latency."""
    sizes = {w for w, _, _ in points}
    if len(sizes) != 1 or len({n for _, n, _ in points}) < 2:
        raise ValueError("fit needs points of one world size at two buffer sizes at least")
    w = sizes.pop()
    xs, ys = [float(n) for _, n, _ in points], [t for _, _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError(f"collective times do not grow with the buffer (slope {slope:.3g} s/B): measure again")
    return {"collective_gbps": (w - 1) / w / slope / 1e9, "collective_latency_s": max(0.0, intercept) / (w - 1)}


def measure_collectives(world_size: int, backend: str = "nccl", *, sizes: tuple[int, ...] | None = None,
                        repeats: int = 5) -> dict[str, float]:
    """Time the collectives over ``world_size`` new processes (see the module docstring) and fit them."""
    if world_size < 2:
        raise ValueError(f"measuring collectives needs 2 processes at least, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs; {torch.cuda.device_count()} are visible")
    sizes = sizes or (GPU_SIZES if backend == "nccl" else CPU_SIZES)
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world_size, port, backend, sizes, repeats, tmp))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        codes = join_all(procs, START_TIMEOUT_S)
        if any(c != 0 for c in codes):
            why = Path(tmp, "error.txt").read_text() if Path(tmp, "error.txt").exists() else f"exit codes {codes}"
            raise RuntimeError(f"measuring the collectives over {world_size} {backend} processes failed: {why}")
        points = json.loads(Path(tmp, "times.json").read_text())
    return fit([(world_size, n, t) for n, t in points])


def _rank(rank: int, world: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int, out: str) -> None:
    import torch.distributed as dist
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=START_TIMEOUT_S))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=START_TIMEOUT_S))
        dtype = torch.bfloat16 if backend == "nccl" else torch.float32
        points = []
        for n in sizes:
            numel = max(world, n // dtype.itemsize // world * world)
            full = torch.zeros(numel, dtype=dtype, device=dev)
            shard = torch.ones(numel // world, dtype=dtype, device=dev)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            for op, args in ((gather, (full, shard)), (scatter, (shard, full))):
                points.append((numel * dtype.itemsize, _slowest(op, args, repeats, dev)))
        if rank == 0:
            Path(out, "times.json").write_text(json.dumps(points))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported by the parent in one line
        Path(out, "error.txt").write_text(f"rank {rank}: {type(e).__name__}: {e}")
        os._exit(1)


def _slowest(op, args: tuple, repeats: int, dev: torch.device) -> float:
    """The median over ``repeats`` of the slowest rank's time of ``op(*args)`` (after one warm-up)."""
    import torch.distributed as dist

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    op(*args)
    times = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        op(*args)
        sync()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)
