"""The memory budgets a plan must meet, in bytes, from the sizes a caller gives and the hardware profile's
defaults, and how to say which one a plan exceeds."""

from __future__ import annotations

import warnings

import torch

from ..ir import GiB, Plan, PlanError
from ..units import format_size, parse_size


class BudgetError(PlanError):
    """No plan fits the memory budgets; the message states the smallest budget that would."""


def host_reserve(host_bytes: int) -> int:
    """Host memory a plan leaves to the rest of the process and the system when the budget is the machine's
    whole memory: 4 GiB + 5% (the OS and page cache, Python, CUDA's host side, the data pipeline)."""
    return int(4 * GiB + 0.05 * host_bytes)


def held_host_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers in host memory: the caller holds them while the
    runtime's store holds its own copy (a meta model, a preset name or a config holds none)."""
    if not isinstance(model, torch.nn.Module):
        return 0
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def binding(plan: Plan, budgets: dict) -> str | None:
    """The budget ``plan`` exceeds, with the figures (None: it fits them all)."""
    pred = plan.predicted
    for tier, key in (("GPU", "gpu_bytes"), ("host", "host_bytes"), ("NVMe", "nvme_bytes")):
        need = pred[f"peak_{key}"]
        cap = budgets.get(key) or 0
        if need > cap:
            left = (f" (what {budgets['gpu_total_bytes'] / GiB:.2f} GiB leaves after the "
                    f"{budgets['gpu_reserve_bytes'] / GiB:.2f} GiB reserve)" if tier == "GPU" else "")
            return (f"{tier} memory: its leanest plan ({plan.decisions.policy}, micro-batch {plan.micro_batch}) "
                    f"peaks at {need / GiB:.2f} GiB, over the budget of {cap / GiB:.2f} GiB{left}")
    return None


def make_budgets(hw, gpu_memory=None, host_memory=None, nvme_dir=None, nvme_memory=None, reserve=None,
                 held_bytes: int = 0) -> dict:
    """Budgets in bytes from sizes (``"24GiB"``) or byte counts; defaults from the hardware profile.
    The GPU budget the plan must meet is the given memory less ``reserve`` (CUDA context, cuBLAS
    workspaces, allocator fragmentation; default 1.5 GiB + 5%: on the H200 a plan 2.2 GiB under a
    24 GiB cap still met 1.6 GiB of reserved-but-unused allocator blocks).  The host budget defaults to
    the profile's host memory less ``host_reserve`` and less ``held_bytes`` (the model the caller holds:
    a 7B model's bf16 weights are 14 GiB beside the store); a given ``host_memory`` is taken as is."""

    def size(v, default, name):
        if v is None:
            return default
        try:
            return parse_size(v)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    gpu = size(gpu_memory, hw.gpu_memory_bytes, "gpu_memory")
    if gpu_memory is not None and hw.has_gpu and gpu > hw.gpu_memory_bytes:
        warnings.warn(f"GPU memory {format_size(gpu)} is more than the {format_size(hw.gpu_memory_bytes)} of the "
                      f"{hw.name} profile's {hw.gpu_name}: the plan will not run on that GPU (name the GPU's own "
                      f"profile with --hardware)", stacklevel=3)
    res = int(1.5 * GiB + 0.05 * gpu) if reserve is None else (0 if reserve == 0 else size(reserve, 0, "reserve"))
    budgets = {"gpu_bytes": gpu - res, "gpu_total_bytes": gpu, "gpu_reserve_bytes": res,
               "host_bytes": size(host_memory, hw.host_memory_bytes - host_reserve(hw.host_memory_bytes) - held_bytes,
                                  "host_memory"),
               "nvme_bytes": size(nvme_memory, 0, "nvme_memory") if nvme_dir else 0, "nvme_dir": nvme_dir}
    if budgets["gpu_bytes"] <= 0:
        bare = isinstance(gpu_memory, str) and gpu_memory.strip().replace("_", "").isdigit()
        raise BudgetError(f"GPU memory {format_size(gpu)} is below the reserve of {format_size(res)}"
                          + (f" ({gpu_memory!r} has no unit, so it is bytes: write e.g. {gpu_memory.strip()}GiB)"
                             if bare else ""))
    return budgets
