"""Exact-size page-locked host buffers (runtime/pinned.py): registered at their size, unregistered when the
last view dies, and the caching allocator where registration fails."""

import gc
import types

import pytest
import torch

from lazytrain.runtime import pinned


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; ``rc`` is what register returns."""

    def __init__(self, rc: int = 0):
        self.rc = rc
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):
        if self.rc == 0:
            self.registered[ptr] = size
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def fake(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return rt


def test_a_large_buffer_is_registered_at_its_exact_size_and_unregistered_with_its_last_view(fake):
    n = pinned.EXACT_MIN_BYTES // 4 + 3          # not a power of two
    t = pinned.pinned_empty(n, torch.float32)
    assert t.dtype == torch.float32 and t.numel() == n and t.is_contiguous()
    assert fake.registered == {t.data_ptr(): 4 * n}
    assert t.data_ptr() % pinned.PAGE == 0
    t.fill_(1.5)
    view = t[10:20]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert fake.unregistered == []                # a view still holds the memory
    assert view.sum().item() == 15.0
    del view
    gc.collect()
    assert fake.unregistered == [ptr]


def test_a_failed_registration_falls_back_to_the_caching_allocator(fake, monkeypatch):
    fake.rc = 712                                # cudaErrorHostMemoryAlreadyRegistered
    calls = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kw):
        calls.append(pin_memory)
        return real_empty(*args, **kw)
    monkeypatch.setattr(pinned, "torch", types.SimpleNamespace(**{**vars(torch), "empty": empty}))
    t = pinned.pinned_empty(pinned.EXACT_MIN_BYTES // 2, torch.bfloat16)
    assert t.numel() == pinned.EXACT_MIN_BYTES // 2 and calls.count(True) == 1 and fake.registered == {}


def test_unpinned_and_empty_buffers_never_touch_cuda(fake):
    assert pinned.host_empty(1 << 30, torch.uint8, pin=False).numel() == 1 << 30
    assert pinned.host_empty(0, torch.uint8, pin=True).numel() == 0
    assert fake.registered == {}


@pytest.mark.cuda
def test_registered_buffers_are_pinned_and_copy_asynchronously_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = pinned.EXACT_MIN_BYTES // 2 + 1
    host = pinned.pinned_empty(n, torch.bfloat16)
    assert host.is_pinned()
    host.copy_(torch.arange(n, dtype=torch.float32).to(torch.bfloat16))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = host.to("cuda", non_blocking=True)
        back = pinned.pinned_empty(n, torch.bfloat16)
        back.copy_(dev, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, host)
