"""Timing one piece of work the way every measurement here does: one warm-up call, then the median of ``repeats``
calls; work on a GPU timed with CUDA events (what the device spent, not the host's launch time), on the CPU with
the wall clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
