"""The NVMe tier's file I/O (``runtime/nvme.py``): round trips of every dtype and size through the direct and the
buffered path, state files preallocated and overwritten in place, full disks, file systems without ``O_DIRECT``,
symlinks."""

import errno
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from lazytrain.runtime import nvme
from lazytrain.runtime.nvme import ALIGN, NvmeError, NvmeFile, NvmeStore, aligned_empty

#: small requests, so a few KiB already make several requests in flight
REQ = 2 * ALIGN
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool]
#: elements: none, one, an unaligned byte count, and several requests with an unaligned tail
SIZES = [0, 1, 1027, 5 * REQ + 3]


def _store(tmp_path, **kw) -> NvmeStore:
    return NvmeStore(tmp_path / "nvme", request_bytes=REQ, queue_depth=3, **kw)


def _random(numel: int, dtype: torch.dtype, *, aligned: bool) -> torch.Tensor:
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = aligned_empty(nbytes + (0 if aligned else 8), pin=False)
    t = (raw if aligned else raw[8:]).view(dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return t


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(tmp_path, dtype, numel, aligned, direct):
    store = _store(tmp_path, direct=direct)
    src = _random(numel, dtype, aligned=aligned)
    f = store.write("act1_mb0_x", src)
    assert f.nbytes == src.numel() * src.element_size() == os.path.getsize(f.path)
    dst = _random(numel, dtype, aligned=not aligned)
    store.read(f, dst)
    assert torch.equal(src.view(torch.uint8) if numel else src, dst.view(torch.uint8) if numel else dst)
    assert store.bytes_written == store.bytes_read == f.nbytes
    store.close()


def test_a_tensor_of_any_shape_reads_back_as_bytes_and_as_itself(tmp_path):
    store = _store(tmp_path)
    x = torch.randn(3, 5, 7).to(torch.bfloat16)
    f = store.write("w", x)
    y = torch.empty(3, 5, 7, dtype=torch.bfloat16)
    store.read(f, y)
    assert torch.equal(x, y)
    raw = torch.empty(f.nbytes, dtype=torch.uint8)
    store.read(f, raw)
    assert torch.equal(raw, x.view(torch.uint8).reshape(-1))
    with pytest.raises(ValueError, match="expected 210 bytes"):
        store.read(f, torch.empty(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        store.write("t", x.transpose(0, 1))


def test_aligned_empty_is_page_aligned():
    for n in (0, 1, 4095, 4096, 3 * REQ + 5):
        t = aligned_empty(n, pin=False)
        assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() % ALIGN == 0
    with pytest.raises(ValueError):
        aligned_empty(-1, pin=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
def test_aligned_empty_pinned_is_page_aligned_and_pinned():
    for n in (1, 5000, 70 << 20):
        t = aligned_empty(n, pin=True)
        assert t.numel() == n and t.data_ptr() % ALIGN == 0 and t.is_pinned()


def test_large_transfers_run_several_requests_on_the_pool(tmp_path, monkeypatch):
    store = _store(tmp_path)
    real, seen = os.pwritev, []

    def spy(fd, bufs, offset):
        seen.append((threading.current_thread().name, offset, sum(len(b) for b in bufs)))
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "pwritev", spy)
    store.write("big", _random(8 * REQ, torch.uint8, aligned=True))
    assert sorted(o for _, o, _ in seen) == [i * REQ for i in range(8)]
    assert all(n == REQ for _, _, n in seen)
    assert all(name.startswith("lazytrain-nvme-io") for name, _, _ in seen)


def test_direct_io_where_the_file_system_takes_it(tmp_path, monkeypatch):
    store = _store(tmp_path)
    if not store.direct:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    real, flags = os.open, []
    monkeypatch.setattr(os, "open", lambda p, fl, *a: flags.append(fl) or real(p, fl, *a))
    store.write("a", _random(3 * ALIGN, torch.uint8, aligned=True))
    assert flags and all(fl & os.O_DIRECT for fl in flags)         # aligned, no tail: one direct open
    flags.clear()
    store.write("b", _random(3 * ALIGN + 5, torch.uint8, aligned=True))
    assert [bool(fl & os.O_DIRECT) for fl in flags] == [True, False]    # the 5-byte tail is buffered
    flags.clear()
    store.write("c", _random(3 * ALIGN, torch.uint8, aligned=False))
    assert [bool(fl & os.O_DIRECT) for fl in flags] == [False]          # an unaligned buffer is buffered


def test_buffered_io_drops_its_pages_from_the_cache(tmp_path, monkeypatch):
    store = _store(tmp_path, direct=False)
    real, advised = os.posix_fadvise, []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: advised.append((o, n, a)) or real(fd, o, n, a))
    src = _random(2 * REQ + 100, torch.uint8, aligned=True)
    f = store.write("a", src)
    store.read(f, torch.empty_like(src))
    spans = [(0, REQ, os.POSIX_FADV_DONTNEED), (REQ, REQ, os.POSIX_FADV_DONTNEED),
             (2 * REQ, 100, os.POSIX_FADV_DONTNEED)]
    assert sorted(advised) == sorted(spans * 2)


def _refuse_direct(monkeypatch, *, at_open: bool) -> list:
    """os.open (or the first request on a direct descriptor) fails with EINVAL for O_DIRECT, as tmpfs does."""
    real_open, real_pwritev, direct_fds, refused = os.open, os.pwritev, set(), []

    def fake_open(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            if at_open:
                refused.append(path)
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            fd = real_open(path, flags, *a)
            direct_fds.add(fd)
            return fd
        fd = real_open(path, flags, *a)
        direct_fds.discard(fd)
        return fd

    def fake_pwritev(fd, bufs, offset):
        if fd in direct_fds:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, bufs, offset)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "pwritev", fake_pwritev)
    return refused


def test_no_direct_io_at_construction_means_buffered(tmp_path, monkeypatch):
    refused = _refuse_direct(monkeypatch, at_open=True)
    store = _store(tmp_path)
    assert not store.direct and refused
    src = _random(4 * REQ + 7, torch.float32, aligned=True)
    f = store.write("a", src)
    dst = torch.empty_like(src)
    store.read(f, dst)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))      # random bits: NaNs compare by bytes


@pytest.mark.parametrize("at_open", [True, False])
def test_direct_io_refused_mid_run_falls_back_to_buffered(tmp_path, monkeypatch, caplog, at_open):
    store = _store(tmp_path)
    if not store.direct:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    refused = _refuse_direct(monkeypatch, at_open=at_open)
    src = _random(4 * REQ, torch.int64, aligned=True)
    f = store.write("a", src)
    assert refused and not store.direct and "refuses direct I/O" in caplog.text
    state = store.preallocate("state", f.nbytes)
    store.write_into(state, src)
    for g in (f, state):
        dst = torch.zeros_like(src)
        store.read(g, dst)
        assert torch.equal(src, dst)


def test_write_into_overwrites_in_place(tmp_path, monkeypatch):
    store = _store(tmp_path)
    a = _random(3 * REQ + 11, torch.bfloat16, aligned=True)
    f = store.preallocate("blk3_param", a.numel() * 2)
    assert os.path.getsize(f.path) == f.nbytes
    inode = os.stat(f.path).st_ino
    store.write_into(f, a)
    b = _random(3 * REQ + 11, torch.bfloat16, aligned=False)
    real, flags = os.open, []
    monkeypatch.setattr(os, "open", lambda p, fl, *args: flags.append(fl) or real(p, fl, *args))
    store.write_into(f, b)
    monkeypatch.undo()
    assert flags and not any(fl & (os.O_TRUNC | os.O_CREAT) for fl in flags)
    assert os.stat(f.path).st_ino == inode and os.path.getsize(f.path) == f.nbytes
    got = torch.empty_like(b)
    store.read(f, got)
    assert torch.equal(got.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="holds 6166 bytes"):
        store.write_into(NvmeFile(f.path, 6166), b)
    os.unlink(f.path)
    with pytest.raises(NvmeError, match="is missing: preallocate it"):
        store.write_into(f, b)
    with pytest.raises(NvmeError, match="would leave"):
        store.write_into(NvmeFile(str(tmp_path / "elsewhere.bin"), f.nbytes), b)


def test_preallocate_reuses_a_file_and_cuts_it_to_size(tmp_path):
    store = _store(tmp_path)
    f = store.preallocate("s", 5 * REQ)
    store.write_into(f, torch.full((5 * REQ,), 7, dtype=torch.uint8))
    g = store.preallocate("s", 2 * REQ + 1)
    assert g.path == f.path and os.path.getsize(g.path) == 2 * REQ + 1
    assert os.stat(g.path).st_blocks * 512 >= 2 * REQ + 1           # its blocks are reserved
    z = store.preallocate("empty", 0)
    assert os.path.getsize(z.path) == 0


def test_preallocate_on_a_full_folder_names_the_figures_and_leaves_nothing(tmp_path, monkeypatch):
    store = _store(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, (10 << 30) - 4096, 4096))
    with pytest.raises(NvmeError, match=r"cannot hold blk0_m\.bin: it needs 0\.00 GiB more \(1048576 bytes\) and "
                                        r"0\.00 GiB \(4096 bytes\) are free"):
        store.preallocate("blk0_m", 1 << 20)
    assert not list(store.root.iterdir())


def test_preallocate_when_fallocate_finds_the_disk_full(tmp_path, monkeypatch):
    store = _store(tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NvmeError, match=f"NVMe folder {store.root} cannot hold blk0_m.bin"):
        store.preallocate("blk0_m", 1 << 20)
    assert not list(store.root.iterdir())


def test_preallocate_writes_zeros_where_fallocate_is_missing(tmp_path, monkeypatch):
    store = _store(tmp_path)

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    f = store.preallocate("s", 3 * REQ + 9)
    assert Path(f.path).read_bytes() == bytes(3 * REQ + 9)


@pytest.mark.parametrize("how", ["write", "write_into"])
def test_a_disk_that_fills_up_during_a_write_is_a_clear_error(tmp_path, monkeypatch, how):
    store = _store(tmp_path)
    src = _random(4 * REQ, torch.uint8, aligned=True)
    f = store.preallocate("s", src.numel()) if how == "write_into" else None
    real, calls = os.pwritev, []

    def filling(fd, bufs, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "pwritev", filling)
    with pytest.raises(NvmeError, match=rf"NVMe folder {store.root} ran out of space writing s\.bin "
                                        rf"\(0\.00 GiB, 32768 bytes; .* bytes free\)"):
        store.write("s", src) if how == "write" else store.write_into(f, src)
    assert store.bytes_written == 0
    if how == "write":
        assert not list(store.root.iterdir())        # no half-written spill is left behind


def test_a_short_file_is_an_error_not_a_partial_read(tmp_path):
    store = _store(tmp_path)
    f = store.write("a", torch.ones(100, dtype=torch.uint8))
    os.truncate(f.path, 60)
    with pytest.raises(NvmeError, match="holds only 60 of its 100 bytes"):
        store.read(f, torch.empty(100, dtype=torch.uint8))


def test_symlinks_are_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    store = _store(tmp_path)
    link = Path(store.path("blk1_param"))
    link.symlink_to(outside)
    x = torch.zeros(8, dtype=torch.uint8)
    for attempt in (lambda: store.write("blk1_param", x), lambda: store.preallocate("blk1_param", 8),
                    lambda: store.write_into(NvmeFile(str(link), 8), x),
                    lambda: store.read(NvmeFile(str(link), 8), x), lambda: store.sync(NvmeFile(str(link), 8))):
        with pytest.raises(OSError):
            attempt()
    assert outside.read_text() == "precious"


def test_sync_flushes_the_file_and_its_folder(tmp_path, monkeypatch):
    store = _store(tmp_path)
    f = store.preallocate("s", 10)
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.realpath(f"/proc/self/fd/{fd}")))
    store.sync(f)
    assert synced == [f.path, str(store.root)]


def test_a_missing_folder_is_created_and_bad_settings_are_refused(tmp_path):
    store = NvmeStore(tmp_path / "a" / "b")
    assert store.root.is_dir() and store.request_bytes == nvme.REQUEST_BYTES and store.queue_depth == nvme.QUEUE_DEPTH
    with pytest.raises(ValueError, match="multiple of 4096"):
        NvmeStore(tmp_path, request_bytes=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        NvmeStore(tmp_path, queue_depth=0)


def test_disk_rates_measure_through_the_tier_and_leave_nothing(tmp_path):
    from lazytrain.measure.disk import disk_rates
    rates = disk_rates(tmp_path, 4 << 20, request_bytes=1 << 20, queue_depth=2, repeats=2)
    assert {k for k, v in rates.items() if k.endswith("_gbps") and v > 0} == \
        {"nvme_read_gbps", "nvme_write_gbps", "nvme_both_gbps"}
    assert (rates["nvme_queue_depth"], rates["nvme_request_bytes"]) == (2, 1 << 20)
    assert rates["direct"] == NvmeStore(tmp_path / "probe").direct
    assert not [p for p in tmp_path.iterdir() if p.name != "probe"]
