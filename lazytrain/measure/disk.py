"""Disk rates as the NVMe tier moves its bytes: read, write, and both at once, through ``runtime/nvme.py``.

``disk_rates`` times the state-file path the runtime runs every step: two preallocated files, each overwritten in
place from a 4096-aligned host buffer (``write_into``) and read back into one (``read``), in requests of
``request_bytes`` with ``queue_depth`` in flight, ``O_DIRECT`` where the file system takes it.  Timings are of what
reaches the drive: a write's time includes the ``fsync`` after it (cheap after direct I/O, the writeback after
buffered I/O), and the page cache of a file is dropped (``posix_fadvise``) before it is read.  "Both" reads one file
while another thread overwrites the other, as a step's update reads a block's state while the previous block's is
written back; its rate is the sum, bytes read plus bytes written over the time both take.  ``lazytrain profile``
records these (``nvme_read_gbps``, ``nvme_write_gbps``, ``nvme_both_gbps``, ``nvme_queue_depth``,
``nvme_request_bytes``); ``benchmarks/nvme_io.py`` sweeps request sizes and queue depths with it.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..runtime.nvme import QUEUE_DEPTH, REQUEST_BYTES, NvmeFile, NvmeStore, aligned_empty

__all__ = ["disk_rates"]

#: the random pattern the buffers repeat (incompressible for a drive that compresses)
_PATTERN = 1 << 20


def _drop_cache(f: NvmeFile) -> None:
    fd = os.open(f.path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _filled(nbytes: int) -> torch.Tensor:
    buf = aligned_empty(nbytes, pin=False)
    pattern = torch.randint(0, 256, (min(_PATTERN, nbytes),), dtype=torch.uint8)
    for a in range(0, nbytes, len(pattern)):
        buf[a:a + len(pattern)] = pattern[:nbytes - a]
    return buf


def disk_rates(directory: str | os.PathLike | None, nbytes: int, *, request_bytes: int = REQUEST_BYTES,
               queue_depth: int = QUEUE_DEPTH, direct: bool | None = None, repeats: int = 1) -> dict:
    """Median GB/s over ``repeats`` of reading, writing and both at once with two files of ``nbytes`` in
    ``directory`` (default: a temporary folder), and the settings measured at (module docstring).  Returns the
    ``HardwareProfile`` fields ``nvme_read_gbps``, ``nvme_write_gbps``, ``nvme_both_gbps``, ``nvme_queue_depth``,
    ``nvme_request_bytes``, and ``direct``: whether the transfers went ``O_DIRECT``."""
    store = NvmeStore(directory, need_bytes=2 * nbytes, direct=direct, request_bytes=request_bytes,
                      queue_depth=queue_depth)
    tag = f"lazytrain-disk-{os.getpid()}-{threading.get_ident()}"
    files: list[NvmeFile] = []
    try:
        src, dst = _filled(nbytes), aligned_empty(nbytes, pin=False)
        files = [store.preallocate(f"{tag}-{k}", nbytes) for k in "ab"]
        one, two = files
        store.write_into(two, src)              # the file "both" reads while the other is written
        store.sync(two)
        times: dict[str, list[float]] = {"read": [], "write": [], "both": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.write_into(one, src)
            store.sync(one)
            times["write"].append(time.perf_counter() - t0)
            _drop_cache(one)
            t0 = time.perf_counter()
            store.read(one, dst)
            times["read"].append(time.perf_counter() - t0)
            _drop_cache(two)
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-disk-read") as pool:
                t0 = time.perf_counter()
                reading = pool.submit(store.read, two, dst)
                store.write_into(one, src)
                store.sync(one)
                reading.result()
                times["both"].append(time.perf_counter() - t0)
        if not torch.equal(dst[:_PATTERN], src[:_PATTERN]):
            raise RuntimeError(f"the disk at {store.root} read back other bytes than were written")
        rate = {k: (2 if k == "both" else 1) * nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        return {"nvme_read_gbps": rate["read"], "nvme_write_gbps": rate["write"], "nvme_both_gbps": rate["both"],
                "nvme_queue_depth": store.queue_depth, "nvme_request_bytes": store.request_bytes,
                "direct": store.direct}
    finally:
        for f in files:
            store.delete(f)
        store.close()

