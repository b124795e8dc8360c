"""This machine's CPU cores and memory, as a process here may use them (its CPU affinity, its container's memory
limit): what the built-in CPU profile, the measured hardware profile and the training run's thread counts read."""

from __future__ import annotations

import os
from pathlib import Path


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup limit when that is lower (containers)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of them where the system cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
