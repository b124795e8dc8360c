"""The training state a plan keeps on NVMe (``Decisions.nvme_state``): one file per block and component, the host
copies the ``state_read`` / ``state_write`` / ``free`` ops move, and the state brought in whole between steps.

Per placed (component, block) a file in the NVMe folder holds what the host store would:

- ``params``: the block's load buffer (its owned parameters, in the plan's parameter dtype);
- ``grads``: its host gradient buffer (the host gradient dtype, every parameter it reads);
- ``ostate``: the optimizer's ``streamed_state(block)`` (master low half or fp32 master, moments, step counts),
  packed one tensor after another at 64-byte offsets (``OstateLayout``).

While a component is only in its file, the host store and the optimizer hold empty placeholders for it: a host
copy exists only from a ``state_read`` to its ``free`` (a pooled buffer, ``HostPool``), which is what makes the
host footprint the plan's (``verify`` counts those copies).  An update of a block with placed state runs
``HostOptimizer.step_streamed`` on the copies (the same arithmetic as ``step`` on the host store, bit for bit).

Between steps (a flush, a checkpoint, reading the weights) ``installed(j)`` reads a block's placed components into
fresh host tensors and hands them to the store and the optimizer, then (``write_back``) writes them out and puts
the placeholders back, so everything that reads the host store works unchanged, one block at a time.

Files are written in place (``NvmeStore.write_into``) and never fsynced: they are scratch state, rebuilt from a
checkpoint on resume; a checkpoint copies what they hold into its own files (``checkpoint.py``), so a kill in
the middle of a state write loses nothing that was committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..ir import TensorKind
from .nvme import NvmeFile, NvmeStore
from .optim.base import HostOptimizer
from .store import HostCopy, HostPool, HostStore

_PARAMS, _GRADS, _OSTATE = TensorKind.PARAMS, TensorKind.GRADS, TensorKind.OPT_STATE
#: the byte alignment of each tensor in an ``ostate`` file (every dtype's)
_ALIGN = 64


@dataclass(frozen=True)
class OstateLayout:
    """Where each tensor of ``streamed_state(block)`` sits in the block's ``ostate`` file."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]     # name, dtype, shape, byte offset
    nbytes: int

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> OstateLayout:
        out, off = [], 0
        for name, t in state.items():
            out.append((name, t.dtype, tuple(t.shape), off))
            off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return cls(tuple(out), off)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named tensors, views of the byte buffer ``buf``."""
        out = {}
        for name, dtype, shape, off in self.entries:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out[name] = buf[off:off + n].view(dtype).view(shape)
        return out

    def placeholders(self) -> dict[str, torch.Tensor]:
        return {name: torch.empty(0, dtype=dtype) for name, dtype, _, _ in self.entries}


class NvmeState:
    """The files of the placed state, and the moves between them and the host (module docstring)."""

    def __init__(self, nvme: NvmeStore, placed: frozenset, store: HostStore, optimizer: HostOptimizer,
                 pool: HostPool):
        self.nvme, self.store, self.optimizer, self.pool = nvme, store, optimizer, pool
        #: (tensor kind, block) pairs kept on NVMe (``Sizes.nvme``), and the blocks with any
        self.placed = frozenset(placed)
        self.blocks = frozenset(j for _, j in self.placed)
        self.files: dict[tuple[TensorKind, int], NvmeFile] = {}
        self.ostate: dict[int, OstateLayout] = {}

    def has(self, kind: TensorKind, j: int) -> bool:
        return (kind, j) in self.placed

    # ---- set-up ---------------------------------------------------------------------------------
    def take_block(self, j: int) -> None:
        """After the optimizer's ``setup(j, ...)`` on the store's buffers: write block j's placed components to
        their files and leave placeholders in the store and the optimizer."""
        lay = self.store.layouts[j]
        if self.has(_OSTATE, j):
            state = self.optimizer.streamed_state(j)
            layout = self.ostate[j] = OstateLayout.of(state)
            buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
            for name, view in layout.views(buf).items():
                view.copy_(state[name])
            self._write_new(_OSTATE, j, buf)
        if self.has(_PARAMS, j):
            self._write_new(_PARAMS, j, _bytes(self.store.load[j]))
        if self.has(_GRADS, j):
            grad = torch.zeros(lay.numel, dtype=self.store.grad_dtype)
            self._write_new(_GRADS, j, _bytes(grad))
        self._drop(j)

    def _write_new(self, kind: TensorKind, j: int, buf: torch.Tensor) -> None:
        f = self.nvme.preallocate(_tag(kind, j), buf.numel())
        self.nvme.write_into(f, buf)
        self.files[(kind, j)] = f

    def _drop(self, j: int) -> None:
        """Placeholders where block j's placed components were."""
        if self.has(_PARAMS, j):
            self.store.load[j] = torch.empty(0, dtype=self.store.param_dtype)
        if self.has(_GRADS, j):
            self.store.grad[j] = torch.empty(0, dtype=self.store.grad_dtype)
        state = self.ostate[j].placeholders() if self.has(_OSTATE, j) else {}
        load = self.store.load[j] if self.has(_PARAMS, j) else None
        if state or load is not None:
            self.optimizer.set_streamed_state(j, state, load=load)

    # ---- host copies (the ops) --------------------------------------------------------------------
    def nbytes(self, kind: TensorKind, j: int) -> int:
        return self.files[(kind, j)].nbytes

    def host_copy(self, kind: TensorKind, j: int, buf: torch.Tensor) -> dict:
        """The payload of a host copy of (kind, j) in pooled byte buffer ``buf``: ``{"buf": HostCopy}``, and for
        the optimizer state its named views (``"state"``)."""
        if kind is _OSTATE:
            return {"buf": HostCopy(buf, buf), "state": self.ostate[j].views(buf)}
        dtype = self.store.param_dtype if kind is _PARAMS else self.store.grad_dtype
        return {"buf": HostCopy(buf, buf.view(dtype))}

    def empty_copy(self, kind: TensorKind, j: int) -> dict:
        """A host copy of (kind, j) in a buffer from the pool (contents undefined)."""
        return self.host_copy(kind, j, self.pool.acquire(self.nbytes(kind, j)))

    def read(self, kind: TensorKind, j: int, payload: dict) -> None:
        """Fill a host copy from its file (on the NVMe worker)."""
        self.nvme.read(self.files[(kind, j)], payload["buf"].buf)

    def write(self, kind: TensorKind, j: int, payload: dict) -> None:
        """Put a host copy back into its file (on the NVMe worker)."""
        self.nvme.write_into(self.files[(kind, j)], payload["buf"].buf)

    # ---- whole blocks, between steps --------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self, j: int, *, write_back: bool = False, grads: bool = False) -> Iterator[None]:
        """Block j's placed parameters and optimizer state (and gradient, with ``grads``) in the host store and the
        optimizer, as if never placed; written back to their files on the way out with ``write_back``."""
        if j not in self.blocks:
            yield
            return
        kinds = [k for k in (_PARAMS, _OSTATE) + ((_GRADS,) if grads else ()) if self.has(k, j)]
        copies = {k: self.host_copy(k, j, torch.empty(self.nbytes(k, j), dtype=torch.uint8)) for k in kinds}
        for k, c in copies.items():
            self.read(k, j, c)
        if _PARAMS in copies:
            self.store.load[j] = copies[_PARAMS]["buf"].tensor
        if _GRADS in copies:
            self.store.grad[j] = copies[_GRADS]["buf"].tensor
        state = copies[_OSTATE]["state"] if _OSTATE in copies else {}
        load = self.store.load[j] if _PARAMS in copies else None
        if state or load is not None:
            self.optimizer.set_streamed_state(j, state, load=load)
        try:
            yield
            if write_back:
                for k, c in copies.items():
                    if k is not _GRADS:
                        self.write(k, j, c)
        finally:
            self._drop(j)

    def close(self) -> None:
        for f in self.files.values():
            NvmeStore.delete(f)
        self.files.clear()


def _tag(kind: TensorKind, j: int) -> str:
    return f"state_{kind.value}_{j}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a uint8 view."""
    return t.contiguous().view(-1).view(torch.uint8)


