"""NVMe tier: one file per tensor in a folder, written and read by the NVMe worker thread.

A file holds the raw bytes of one contiguous host tensor (no header: dtype and shape stay in the
``NvmeFile`` record the runtime keeps).  Reads go straight into a pinned host buffer
(``readinto``), so the following H2D copy needs no staging.  Files are named by what they hold
(``act3_mb2_<value>.bin``), so a step overwrites the previous step's file of the same tensor.

Safety: file names are made from tags with every character outside ``[A-Za-z0-9_.-]`` replaced, so
no name holds a separator; each path is checked to lie directly in the folder, and files are
opened with ``O_NOFOLLOW``, so a symlink planted in the folder cannot redirect a write elsewhere.
A folder given as a relative path with ``..`` is refused.  The folder is probed at construction:
not writable, or less free space than ``need_bytes`` (the plan's NVMe peak), is an
:class:`NvmeError` before any training starts.
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


class NvmeError(OSError):
    """The NVMe folder cannot be used: not writable, too small, or a path that escapes it."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class NvmeStore:
    def __init__(self, root: str | os.PathLike | None, need_bytes: int = 0):
        self._own = root is None
        if root is not None and not Path(root).is_absolute() and ".." in Path(root).parts:
            raise NvmeError(f"NVMe folder {str(root)!r} climbs out with '..': give an absolute path")
        try:
            self.root = Path(tempfile.mkdtemp(prefix="lazytrain-nvme-")) if root is None else Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
            self.root = self.root.resolve()
            probe = self.root / f".lazytrain-probe-{os.getpid()}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise NvmeError(f"NVMe folder {root} is not writable ({e.strerror or e}): choose another --nvme-dir "
                            f"or fix its permissions") from None
        free = shutil.disk_usage(self.root).free
        if need_bytes > free:
            raise NvmeError(f"NVMe folder {self.root} has {free / 2**30:.2f} GiB free but the plan spills up to "
                            f"{need_bytes / 2**30:.2f} GiB there: free space, or compile with a smaller "
                            f"--nvme-memory")
        self.bytes_written = 0
        self.bytes_read = 0

    def path(self, tag: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", tag) + ".bin"
        path = self.root / name
        if path.parent != self.root:
            raise NvmeError(f"NVMe file name {name!r} would leave {self.root}")
        return str(path)

    def write(self, tag: str, host: torch.Tensor) -> NvmeFile:
        """Write a contiguous host byte tensor (runs on the NVMe thread)."""
        path = self.path(tag)
        view = memoryview(host.numpy())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
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
        with os.fdopen(os.open(f.path, os.O_RDONLY | _NOFOLLOW), "rb", buffering=0) as fh:
            done = 0
            while done < f.nbytes:
                n = fh.readinto(view[done:])
                if not n:
                    raise OSError(f"{f.path}: file ends after {done} of {f.nbytes} bytes")
                done += n
        self.bytes_read += f.nbytes

    def preallocate(self, tag: str, nbytes: int) -> NvmeFile:
        """A file of ``nbytes`` for ``write_into``, its blocks reserved now (a full disk fails here, not mid-run)."""
        path = self.path(tag)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise NvmeError(f"NVMe folder {self.root}: cannot reserve {nbytes / 2**30:.2f} GiB for {tag} "
                            f"({e.strerror or e}, {shutil.disk_usage(self.root).free / 2**30:.2f} GiB free)") from None
        finally:
            os.close(fd)
        return NvmeFile(path, nbytes)

    def write_into(self, f: NvmeFile, host: torch.Tensor) -> None:
        """Overwrite the file ``f`` in place with a contiguous host tensor's bytes (runs on the NVMe thread)."""
        view = memoryview(host.contiguous().view(-1).view(torch.uint8).numpy())
        if len(view) != f.nbytes:
            raise ValueError(f"{f.path}: holds {f.nbytes} bytes, the buffer {len(view)}")
        fd = os.open(f.path, os.O_WRONLY | _NOFOLLOW)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)
        self.bytes_written += len(view)

    @staticmethod
    def delete(f: NvmeFile) -> None:
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
