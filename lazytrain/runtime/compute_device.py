"""The trainer's compute device: CUDA when there is one, with its caching allocator set up for plans."""

from __future__ import annotations

import os

import torch


def device_type(device) -> str:
    """The type of ``device``; for None, CUDA when there is one, else the CPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def compute_device(device) -> torch.device:
    """The compute device (CUDA when available), with the caching allocator set up on CUDA."""
    out = torch.device(device_type(device) if device is None else device)
    if out.type == "cuda" and out.index is None:
        out = torch.device("cuda", torch.cuda.current_device())
    if out.type == "cuda":
        _expandable_segments()
    return out


def _expandable_segments() -> None:
    """Ask the CUDA caching allocator for expandable segments unless the user configured it: blocks
    of many sizes (parameters, activations, loss chunks) otherwise fragment it (reserved but unusable
    memory: [ledger: gpu-reserve]).  Only effective before the process's first CUDA allocation; harmless
    after."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    # the device-generic setter where torch has it (the CUDA one now warns that it is deprecated)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:True")
    except Exception:  # noqa: BLE001 - an allocator without the option: keep the default
        pass
