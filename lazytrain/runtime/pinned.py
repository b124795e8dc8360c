"""Page-locked host buffers of exactly the size asked for.

PyTorch's caching host allocator (``torch.empty(..., pin_memory=True)``) rounds every request up to a
power of two, so a 7B layer's 889 MiB fp32 gradient buffer takes 1 GiB and a 310 MB activation 512 MiB.
The plan's host figures count the bytes the buffers hold, so with the rounding a store that the plan
fits can exceed the host's memory [ledger: pinned-exact].

Large buffers (``EXACT_MIN_BYTES`` and up) are therefore allocated pageable at their exact size, then
page-locked in place with ``cudaHostRegister``; the registration ends (``cudaHostUnregister``) when the
last tensor viewing the memory is freed, before the memory itself is.  Smaller buffers, and any buffer
whose registration fails, come from the caching allocator, whose rounding costs little there.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

log = logging.getLogger("lazytrain")

#: buffers from this size up are page-locked at their exact size, each in an ``mmap`` of its own [ledger: pinned-exact]
EXACT_MIN_BYTES = 64 << 20
#: the address of a registered buffer is aligned to this (the host page size CUDA pins)
PAGE = 4096
#: cudaHostRegisterPortable: pinned for every CUDA context, as the caching allocator's memory is
_PORTABLE = 1

_failed_once = False


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the memory is freed either way
        pass


def _registered(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of pageable memory, page-aligned and registered with CUDA; None where registering fails."""
    global _failed_once
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    ptr = raw.ctypes.data + start
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    except Exception as e:  # noqa: BLE001 - a CUDA runtime without the call: the caching allocator serves
        rc = -1
        why = str(e)
    else:
        why = f"cudaError {rc}"
    if rc != 0:
        if not _failed_once:
            log.warning("lazytrain: cudaHostRegister failed (%s); pinned host buffers fall back to PyTorch's "
                        "allocator, which rounds each up to a power of two", why)
            _failed_once = True
        return None
    weakref.finalize(raw, _unregister, ptr)     # runs before numpy frees ``raw``: unregister, then free
    return torch.from_numpy(raw[start:start + nbytes])   # the tensor's storage keeps ``raw`` alive


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked CPU tensor of ``numel`` elements, holding exactly that many bytes when
    it is large (module docstring)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes >= EXACT_MIN_BYTES and torch.cuda.is_available():
        t = _registered(nbytes)
        if t is not None:
            return t.view(dtype)
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def host_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """``pinned_empty`` when ``pin``, else plain pageable memory (CPU mode: nothing crosses PCIe)."""
    return pinned_empty(numel, dtype) if pin and numel else torch.empty(numel, dtype=dtype)


def aligned_empty(nbytes: int, *, pin: bool) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``nbytes`` whose address is a multiple of ``PAGE`` (4096), so the NVMe
    tier can move it with direct I/O (``runtime/nvme.py``): page-locked (``host_empty``) when ``pin``, else pageable.

    Large pinned buffers are page-aligned already (``_registered``), and so are the CUDA caching allocator's blocks;
    a buffer that is not (another allocator) is taken again ``PAGE`` bytes larger and sliced at its first page."""
    if nbytes < 0:
        raise ValueError(f"a buffer holds a whole, non-negative number of bytes, got {nbytes}")
    if pin:
        t = host_empty(nbytes, torch.uint8, pin=True)
        if t.data_ptr() % PAGE == 0 or not nbytes:
            return t
        t = host_empty(nbytes + PAGE, torch.uint8, pin=True)
        start = (-t.data_ptr()) % PAGE
        return t[start:start + nbytes]
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return torch.from_numpy(raw[start:start + nbytes])      # the tensor's storage keeps ``raw`` alive
