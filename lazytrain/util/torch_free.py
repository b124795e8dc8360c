"""Questions about torch objects asked without importing torch.

Importing torch costs ~1.3 s of CPU, about half of a compile whose trace is cached (the search itself then
takes 1-3 s): the compiler, the trace cache and the argument checks ask only whether an argument is a module or
a dtype, and which torch is installed.  An object of one of torch's classes can exist only once torch is
imported, so where it is not, the answer is no without importing it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _torch():
    return sys.modules.get("torch")


def is_module(obj, kind: str = "Module") -> bool:
    """``isinstance(obj, torch.nn.<kind>)`` (``kind``: "Module", "Sequential", ...)."""
    torch = _torch()
    return torch is not None and isinstance(obj, getattr(torch.nn, kind))


def is_module_class(obj) -> bool:
    """Is ``obj`` a subclass of ``torch.nn.Module`` (a class where an instance was meant)?"""
    torch = _torch()
    return torch is not None and isinstance(obj, type) and issubclass(obj, torch.nn.Module)


def is_dtype(obj) -> bool:
    """``isinstance(obj, torch.dtype)``."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.dtype)


def torch_version() -> str:
    """The installed torch's version, from its package metadata (torch's own ``__version__`` where the metadata
    is missing, e.g. a build run from its source tree)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch
        return torch.__version__


def cuda_device_present() -> bool:
    """Does this machine show an NVIDIA GPU to its kernel?  Looked up before asking torch (which costs its
    import) whether CUDA is usable."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, importing torch only where torch is imported already or a GPU is present."""
    if _torch() is None and not cuda_device_present():
        return False
    import torch
    return torch.cuda.is_available()
