"""NVMe tier: one file per tensor in a folder, written and read by the NVMe worker thread.

A file holds the raw bytes of one contiguous host tensor (no header: dtype and shape stay in the
``NvmeFile`` record the runtime keeps).  Reads go straight into a pinned host buffer
(``readinto``), so the following H2D copy needs no staging.  Files are named by what they hold
(``act3_mb2_<value>.bin``), so a step overwrites the previous step's file of the same tensor.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class NvmeFile:
    path: str
    nbytes: int


class NvmeStore:
    def __init__(self, root: str | os.PathLike | None):
        self._own = root is None
        self.root = Path(tempfile.mkdtemp(prefix="lazytrain-nvme-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_written = 0
        self.bytes_read = 0

    def path(self, tag: str) -> str:
        return str(self.root / (re.sub(r"[^A-Za-z0-9_.-]+", "_", tag) + ".bin"))

    def write(self, tag: str, host: torch.Tensor) -> NvmeFile:
        """Write a contiguous host byte tensor (runs on the NVMe thread)."""
        path = self.path(tag)
        view = memoryview(host.numpy())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)
        self.bytes_written += len(view)
        return NvmeFile(path, len(view))

    def read(self, f: NvmeFile, into: torch.Tensor) -> None:
        """Fill a host byte tensor from the file (runs on the NVMe thread)."""
        view = memoryview(into.numpy())
        if len(view) != f.nbytes:
            raise ValueError(f"{f.path}: expected {f.nbytes} bytes, the buffer holds {len(view)}")
        with open(f.path, "rb", buffering=0) as fh:
            done = 0
            while done < f.nbytes:
                n = fh.readinto(view[done:])
                if not n:
                    raise OSError(f"{f.path}: file ends after {done} of {f.nbytes} bytes")
                done += n
        self.bytes_read += f.nbytes

    @staticmethod
    def delete(f: NvmeFile) -> None:
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
