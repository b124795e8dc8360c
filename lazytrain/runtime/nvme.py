"""NVMe tier: one file per tensor in a folder, moved in large aligned requests, several in flight, direct I/O.

Two kinds of file live there.  *Spills* (``write`` / ``read`` / ``delete``) hold an activation or saved tensor;
``write`` creates or truncates the file each time, and files are named by what they hold (``act3_mb2_<value>.bin``),
so a step overwrites the previous step's file of the same tensor.  *State files* (``preallocate`` / ``write_into`` /
``read`` / ``sync``) hold a block's parameters, gradients or optimizer state: reserved once before training
(``posix_fallocate``: a full disk is an :class:`NvmeError` with the figures then, never mid-run) and overwritten in
place every step.  A file holds the raw bytes of one contiguous host tensor of any dtype (no header: dtype and
shape stay in the ``NvmeFile`` record the runtime keeps).

How the bytes move.  A transfer is cut into requests of ``request_bytes`` (``REQUEST_BYTES``, 8 MiB) and up to
``queue_depth`` (``QUEUE_DEPTH``, 8) of them are in flight at once, each an ``os.pwritev`` / ``os.preadv`` at its own
offset on the store's thread pool: both calls release the GIL, so the requests overlap in the kernel and in the
drive's queue, and a read lands straight in the caller's (pinned) buffer.  Where the folder's file system takes
``O_DIRECT`` (probed at construction) and the buffer's address is a multiple of ``ALIGN`` (4096; ``aligned_empty``
makes such buffers), the 4096-aligned body of the transfer goes direct, buffer to drive with no page-cache copy.
The unaligned tail (under 4096 bytes), an unaligned buffer, and a file system without ``O_DIRECT`` (tmpfs, some
FUSE and network ones: ``EINVAL`` at the open or at the first request, after which the store stays buffered) take
buffered I/O, followed by ``posix_fadvise(DONTNEED)`` on each request's range: that starts the writeback and drops
the cached pages, so the host does not hold the tier's bytes a second time in its page cache.  Nothing on the hot
path calls ``fsync``; a checkpoint calls ``sync(f)``.

Why a thread pool of our own (checked before writing it; the library must read into the caller's aligned, pinned
buffer at an offset, several requests in flight, with ``O_DIRECT``, from a plain thread on a CPU-only machine too):

- ``aiofiles`` runs ordinary buffered file-object calls in an asyncio executor: no positional I/O into a given
  buffer, no ``O_DIRECT``, and the runtime has no event loop;
- ``caio`` / ``aiofile`` (Linux AIO, asyncio): a read returns a new ``bytes`` object (a copy, at an unaligned
  address), and they need an event loop;
- ``libaio`` (python-libaio, ctypes over the system's ``libaio.so``): fits the calls, but adds a system library and
  a completion loop of our own, and kernel AIO is asynchronous only with ``O_DIRECT`` (on tmpfs or buffered files
  ``io_submit`` blocks), so the fallback path would need threads anyway;
- io_uring bindings (``liburing``): Docker's and containerd's default seccomp profiles block the ``io_uring_*``
  calls since 2023 (moby/moby#46762), where most of our users' training runs;
- ``kvikio`` (RAPIDS): its host-memory path is exactly this design (a POSIX thread pool, 4 MiB tasks), but it ships
  as CUDA wheels (``kvikio-cu12`` with cuFile), not installable for the CPU tests and a large dependency for it;
- torch: ``torch.cuda.gds`` is GPUDirect Storage into GPU memory only, ``UntypedStorage.from_file`` a page-cached mmap.

Safety: file names are made from tags with every character outside ``[A-Za-z0-9_.-]`` replaced, so no name holds
a separator; each path is checked to lie directly in the folder, and files are opened with ``O_NOFOLLOW``, so a
symlink planted in the folder cannot redirect a write elsewhere.  A folder given as a relative path with ``..`` is
refused, a missing one is created.  The folder is probed at construction: not writable, or less free space than
``need_bytes`` (the plan's NVMe peak), is an :class:`NvmeError` before any training starts.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from .pinned import PAGE, aligned_empty

__all__ = ["NvmeFile", "NvmeError", "NvmeStore", "aligned_empty", "ALIGN", "REQUEST_BYTES", "QUEUE_DEPTH"]

log = logging.getLogger("lazytrain")

#: direct I/O needs the buffer's address, the file offset and the length to be multiples of this (the page)
ALIGN = PAGE
#: bytes one request moves: 8 MiB reach an NVMe drive's sequential rate (benchmarks/results/nvme_io/)
REQUEST_BYTES = 8 << 20
#: requests in flight at once on a store: 8 of 8 MiB keep a PCIe 4 drive's queue full
QUEUE_DEPTH = 8

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECT = getattr(os, "O_DIRECT", 0)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
#: errors meaning "the disk is full" (a quota counts as full)
_FULL = {errno.ENOSPC, errno.EDQUOT}
#: errors of ``posix_fallocate`` meaning "this file system cannot reserve blocks" (zeros are written instead)
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
GiB = 2**30


@dataclass(frozen=True)
class NvmeFile:
    path: str
    nbytes: int


class NvmeError(OSError):
    """The NVMe folder cannot be used: not writable, too small or full, or a path that escapes it."""


def _bytes_of(t: torch.Tensor, what: str) -> memoryview:
    """The bytes of a contiguous host tensor of any dtype, as a writable flat memoryview."""
    if t.device.type != "cpu":
        raise ValueError(f"the NVMe tier moves host tensors; {what} is on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"the NVMe tier moves contiguous tensors; {what} is not (call .contiguous())")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class NvmeStore:
    """The files of one NVMe folder (module docstring).  ``direct``: None probes the folder for ``O_DIRECT``,
    False never uses it; ``request_bytes`` (a multiple of 4096) and ``queue_depth`` set how the bytes move."""

    def __init__(self, root: str | os.PathLike | None, need_bytes: int = 0, *, direct: bool | None = None,
                 request_bytes: int = REQUEST_BYTES, queue_depth: int = QUEUE_DEPTH):
        if request_bytes <= 0 or request_bytes % ALIGN:
            raise ValueError(f"request_bytes must be a positive multiple of {ALIGN}, got {request_bytes}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
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
            raise NvmeError(f"NVMe folder {self.root} has {free / GiB:.2f} GiB free but the plan spills up to "
                            f"{need_bytes / GiB:.2f} GiB there: free space, or compile with a smaller "
                            f"--nvme-memory")
        self.request_bytes, self.queue_depth = request_bytes, queue_depth
        #: whether the aligned body of a transfer goes ``O_DIRECT`` (turns False for good at the first ``EINVAL``)
        self.direct = bool(_DIRECT) and direct is not False and self._takes_direct(probe)
        self.bytes_written = 0
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # --- names ---------------------------------------------------------------------------------
    def path(self, tag: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", tag) + ".bin"
        path = self.root / name
        if path.parent != self.root:
            raise NvmeError(f"NVMe file name {name!r} would leave {self.root}")
        return str(path)

    def _own_path(self, f: NvmeFile) -> str:
        if Path(f.path).parent != self.root:
            raise NvmeError(f"NVMe file {f.path!r} would leave {self.root}")
        return f.path

    # --- spills --------------------------------------------------------------------------------
    def write(self, tag: str, host: torch.Tensor) -> NvmeFile:
        """Create (or truncate) the tag's file and write a contiguous host tensor into it; a disk that fills up
        midway leaves no file behind."""
        path = self.path(tag)
        view = _bytes_of(host, f"the tensor written to {tag!r}")
        try:
            self._transfer(path, view, host.data_ptr(), write=True,
                           flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW)
        except OSError as e:
            if e.errno in _FULL:
                self.delete(NvmeFile(path, len(view)))
                raise self._full(path, len(view)) from None
            raise
        self._count(written=len(view))
        return NvmeFile(path, len(view))

    def read(self, f: NvmeFile, into: torch.Tensor) -> None:
        """Fill a contiguous host tensor of any dtype (``f.nbytes`` bytes) from the file."""
        view = _bytes_of(into, f"the buffer read from {f.path}")
        if len(view) != f.nbytes:
            raise ValueError(f"{f.path}: expected {f.nbytes} bytes, the buffer holds {len(view)}")
        size = os.lstat(f.path).st_size
        if size < f.nbytes:
            raise NvmeError(f"NVMe file {f.path} holds only {size} of its {f.nbytes} bytes: it was cut short "
                            f"(a full disk, or another process); rerun from the last checkpoint")
        self._transfer(f.path, view, into.data_ptr(), write=False, flags=os.O_RDONLY | _NOFOLLOW)
        self._count(read=f.nbytes)

    @staticmethod
    def delete(f: NvmeFile) -> None:
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass

    # --- state files ---------------------------------------------------------------------------
    def preallocate(self, tag: str, nbytes: int) -> NvmeFile:
        """Create the tag's file (or reuse it, cut to size) and reserve its ``nbytes`` on the disk now, so that a
        full disk is an :class:`NvmeError` before training, never in the middle of a step."""
        if nbytes < 0:
            raise ValueError(f"a state file holds a non-negative number of bytes, got {nbytes}")
        path = self.path(tag)
        existed = os.path.lexists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size > nbytes:
                os.ftruncate(fd, nbytes)
            need = nbytes - min(st.st_blocks * 512, nbytes)
            free = shutil.disk_usage(self.root).free
            if need > free:
                raise self._cannot_hold(path, need, free)
            self._reserve(fd, path, min(st.st_size, nbytes), nbytes, need)
        except BaseException:
            if not existed:
                self.delete(NvmeFile(path, nbytes))
            raise
        finally:
            os.close(fd)
        return NvmeFile(path, nbytes)

    def write_into(self, f: NvmeFile, host: torch.Tensor) -> None:
        """Overwrite a preallocated file in place (no truncate) with a contiguous host tensor of ``f.nbytes``."""
        path = self._own_path(f)
        view = _bytes_of(host, f"the tensor written into {path}")
        if len(view) != f.nbytes:
            raise ValueError(f"{path}: holds {f.nbytes} bytes, the tensor written into it {len(view)}")
        if not os.path.lexists(path):
            raise NvmeError(f"NVMe state file {path} is missing: preallocate it before writing into it")
        try:
            self._transfer(path, view, host.data_ptr(), write=True, flags=os.O_WRONLY | _NOFOLLOW)
        except OSError as e:
            if e.errno in _FULL:       # copy-on-write file systems allocate again on every overwrite
                raise self._full(path, len(view)) from None
            raise
        self._count(written=len(view))

    def sync(self, f: NvmeFile) -> None:
        """Make the file's bytes and its name durable (``fsync`` of the file and of the folder): for a checkpoint,
        never on the hot path."""
        fd = os.open(f.path, os.O_RDONLY | _NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(os.path.dirname(f.path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- how the bytes move --------------------------------------------------------------------
    def _transfer(self, path: str, view: memoryview, address: int, *, write: bool, flags: int) -> None:
        """Move ``view`` to (``write``) or from the file from offset 0: the 4096-aligned body direct where the
        store and the buffer allow it, the rest (or all of it) buffered."""
        n = len(view)
        body = n - n % ALIGN if self.direct and address % ALIGN == 0 else 0
        if body:
            try:
                fd = os.open(path, flags | _DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                body = self._no_direct(e)
            else:
                try:
                    self._requests(fd, path, view, 0, body, write=write, buffered=False)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    body = self._no_direct(e)
                finally:
                    os.close(fd)
        if body == n and n:
            return
        fd = os.open(path, flags & ~os.O_TRUNC if body else flags, 0o600)
        try:
            self._requests(fd, path, view, body, n, write=write, buffered=True)
        finally:
            os.close(fd)

    def _no_direct(self, e: OSError) -> int:
        if self.direct:
            log.warning("lazytrain: %s refuses direct I/O (%s); the NVMe tier uses buffered I/O there", self.root,
                        e.strerror or e)
        self.direct = False
        return 0

    def _requests(self, fd: int, path: str, view: memoryview, start: int, end: int, *, write: bool,
                  buffered: bool) -> None:
        """Bytes ``[start, end)`` in requests of ``request_bytes``, up to ``queue_depth`` in flight; returns when all
        are done (the caller closes ``fd`` then), raising the first error."""
        spans = [(a, min(a + self.request_bytes, end)) for a in range(start, end, self.request_bytes)]
        if len(spans) <= 1 or self.queue_depth == 1:
            for a, b in spans:
                _request(fd, path, view, a, b, write, buffered)
            return
        futures = [self._executor().submit(_request, fd, path, view, a, b, write, buffered) for a, b in spans]
        _first_error(futures)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="lazytrain-nvme-io")
            return self._pool

    def _takes_direct(self, probe: Path) -> bool:
        """Whether the folder's file system opens and writes a file with ``O_DIRECT`` (tmpfs does not)."""
        buf = aligned_empty(ALIGN, pin=False)
        buf.zero_()
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _DIRECT, 0o600)
        except OSError:
            return False
        try:
            os.pwritev(fd, [memoryview(buf.numpy())], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(probe)

    def _reserve(self, fd: int, path: str, size: int, nbytes: int, need: int) -> None:
        """Blocks for bytes ``[0, nbytes)`` of the file now ``size`` long: ``posix_fallocate``, or zeros written
        past ``size`` where the file system has no such call."""
        if not nbytes:
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except AttributeError:
            pass
        except OSError as e:
            if e.errno in _FULL:
                raise self._cannot_hold(path, need, shutil.disk_usage(self.root).free) from None
            if e.errno not in _NO_FALLOCATE:
                raise
        if size >= nbytes:
            return
        zeros = memoryview(bytes(min(self.request_bytes, nbytes - size)))
        try:
            for a in range(size, nbytes, len(zeros)):
                _request(fd, path, zeros, 0, min(len(zeros), nbytes - a), True, True, offset=a)
        except OSError as e:
            if e.errno in _FULL:
                raise self._cannot_hold(path, need, shutil.disk_usage(self.root).free) from None
            raise

    # --- errors and counters -------------------------------------------------------------------
    def _cannot_hold(self, path: str, need: int, free: int) -> NvmeError:
        return NvmeError(f"NVMe folder {self.root} cannot hold {Path(path).name}: it needs {need / GiB:.2f} GiB more "
                         f"({need} bytes) and {free / GiB:.2f} GiB ({free} bytes) are free: free space, give another "
                         f"--nvme-dir, or compile with a smaller --nvme-memory")

    def _full(self, path: str, nbytes: int) -> NvmeError:
        free = shutil.disk_usage(self.root).free
        return NvmeError(f"NVMe folder {self.root} ran out of space writing {Path(path).name} ({nbytes / GiB:.2f} GiB, "
                         f"{nbytes} bytes; {free / GiB:.2f} GiB, {free} bytes free): free space, give another "
                         f"--nvme-dir, or compile with a smaller --nvme-memory")

    def _count(self, *, written: int = 0, read: int = 0) -> None:
        with self._lock:
            self.bytes_written += written
            self.bytes_read += read


def _request(fd: int, path: str, view: memoryview, a: int, b: int, write: bool, buffered: bool, *,
             offset: int | None = None) -> None:
    """One request: ``view[a:b]`` to or from the file at offset ``a`` (or ``offset``), looping over short transfers;
    after a buffered one, the range's pages are dropped from the page cache (their writeback starts)."""
    at = a if offset is None else offset
    done = 0
    while done < b - a:
        part = [view[a + done:b]]
        n = os.pwritev(fd, part, at + done) if write else os.preadv(fd, part, at + done)
        if not n:
            raise NvmeError(f"NVMe file {path} ends at byte {at + done}, {b - a - done} bytes short")
        done += n
    if buffered and _DONTNEED is not None and b > a:
        os.posix_fadvise(fd, at, b - a, _DONTNEED)


def _first_error(futures: Iterable[Future]) -> None:
    """Wait for every request; at the first error cancel those not started, wait for the rest, and raise it."""
    futures = list(futures)
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
