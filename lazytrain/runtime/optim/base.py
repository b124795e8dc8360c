"""The host optimizer interface: what the runtime's ``update`` op calls.

Ownership, chosen so an 8-bit optimizer can keep host memory near 8 bytes/param:
- the runtime owns, per block, the flat *load buffer* (pinned, in the plan's param dtype: what
  ``load`` copies to the GPU) and the flat *gradient buffer* (pinned, what ``grad_offload`` fills);
- the optimizer owns the master weights and its state, however it represents them (fp32 copy,
  or bf16 high half = the load buffer plus 16 low bits, ...), and on every ``step`` writes the new
  parameters into the load buffer.

``segments`` lists the tensors packed in a block's flat buffers as (name, offset, numel, shape),
so an optimizer can treat small tensors (norms, biases) differently.  Gradient clipping is done
by the caller: ``step`` receives the clip coefficient (1.0 when no clipping applies), already
folded from the global norm.  ``step`` must be safe to call from a worker thread concurrently for
different blocks.

GPU-resident blocks: when ``load_buffer`` given to ``setup`` is a CUDA tensor (bf16, or fp32 for fp32
plans), it *is* the block's parameters on the GPU.  The optimizer then keeps all its state for the
block on that device, and ``step`` receives the flat fp32 GPU gradient accumulator (``grad.numel() ==
load_buffer.numel()``) from the thread that issues GPU work, inside ``torch.cuda.stream(...)``: it
queues the update on the current stream and must not synchronise with the host (no ``.item()``, no
branching on device values).  ``master`` and ``state_tensors`` return CPU tensors of the same keys,
dtypes and shapes as for a host block (they may synchronise), and ``load_state_tensors`` takes CPU
tensors, so a checkpoint loads whatever the placement of each block.  ``host_bytes_per_param``
counts host memory only; ``device_bytes_per_param`` gives what a device block costs on the GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Segment = tuple[str, int, int, tuple[int, ...]]


class HostOptimizer(ABC):
    #: bytes of host memory per parameter: load buffer + gradient buffer + master + state
    host_bytes_per_param: float = 16.0
    #: global gradient-norm clip threshold (None: no clipping)
    max_grad_norm: float | None = None

    @abstractmethod
    def setup(self, block: int, init: torch.Tensor, load_buffer: torch.Tensor, segments: list[Segment]) -> None:
        """Take ownership of block ``block``: ``init`` is a flat fp32 copy of its initial parameters
        (the optimizer may keep or discard it), ``load_buffer`` the runtime's flat buffer to write
        updated parameters into."""

    @abstractmethod
    def step(self, block: int, grad: torch.Tensor, clip_coef: float = 1.0, lr: float | None = None) -> None:
        """One update of block ``block`` from its flat gradient (bf16 or fp32, same layout), at
        learning rate ``lr`` (None: ``self.lr`` now).  The runtime passes the rate that was set when
        the gradient's step ran: a lagged update runs during the next step, after a schedule may
        already have moved ``self.lr`` on."""

    @abstractmethod
    def master(self, block: int) -> torch.Tensor:
        """Flat fp32 master weights of the block (a copy or a view)."""

    @abstractmethod
    def state_tensors(self, block: int) -> dict[str, torch.Tensor]:
        """Everything needed to resume this block bit-exactly (for safetensors checkpoints)."""

    @abstractmethod
    def load_state_tensors(self, block: int, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def hyperparameters(self) -> dict:
        """JSON-able hyper-parameters (lr, betas, eps, weight_decay, max_grad_norm, step count)."""

    def device_bytes_per_param(self, param_bytes: int | None = None) -> float:
        """Bytes of device memory per parameter kept for a GPU-resident block beyond its load buffer
        (``param_bytes``: the load buffer's element size, for an estimate before ``setup``).  The
        compiler budgets GPU memory with it; an optimizer without device support raises."""
        raise NotImplementedError(f"{type(self).__name__} does not support GPU-resident blocks")

    # -- GPU-updated streamed blocks (``Decisions.gpu_update``): optional ------------------------------
    def streamed_state(self, block: int) -> dict[str, torch.Tensor]:
        """The host tensors of a streamed block's state beyond its load buffer (master low halves or fp32
        master, moments, step counts), by name: what a GPU update's ``state_load`` copies to the GPU and its
        ``state_store`` back.  Their contents are the block's state: the host and GPU paths share them."""
        raise NotImplementedError(f"{type(self).__name__} does not support GPU-updated streamed blocks")

    def set_streamed_state(self, block: int, state: dict[str, torch.Tensor], load: torch.Tensor | None = None) -> None:
        """Make ``state`` (the keys, dtypes and shapes of ``streamed_state(block)``) the block's state, and ``load``
        (if given) its load buffer, without copying: the runtime moves a block's state into page-locked buffers
        (``pin_streamed_state``), and out to NVMe and back (``runtime/nvme_state.py``: empty placeholders while
        the state is only in its files)."""
        raise NotImplementedError(f"{type(self).__name__} does not support streamed state")

    def pin_streamed_state(self, block: int, alloc) -> None:
        """Move ``streamed_state(block)`` into buffers from ``alloc(numel, dtype)`` (page-locked, so the copies
        to and from the GPU run asynchronously at full PCIe rate)."""
        self.set_streamed_state(block, self.pinned_copies(block, alloc))

    def pinned_copies(self, block: int, alloc) -> dict[str, torch.Tensor]:
        """``streamed_state(block)`` copied into buffers from ``alloc(numel, dtype)``, by name (for
        ``pin_streamed_state``, which puts them in the block's place)."""
        out = {}
        for k, t in self.streamed_state(block).items():
            out[k] = alloc(t.numel(), t.dtype)
            out[k].copy_(t)
        return out

    def step_streamed(self, block: int, grad: torch.Tensor, params: torch.Tensor, state: dict[str, torch.Tensor],
                      clip_coef: float = 1.0, lr: float | None = None) -> None:
        """``step`` for a streamed block on copies of its state: ``params`` a copy of its load buffer (owned
        parameters), ``state`` copies of ``streamed_state(block)`` with the same keys, ``grad`` the flat fp32
        accumulator; all on one device.  On a CUDA device it queues the update on the current stream without
        synchronising, as for a GPU-resident block; on the CPU it runs the host path (CPU mode), so both give
        the host update's results."""
        raise NotImplementedError(f"{type(self).__name__} does not support GPU-updated streamed blocks")

    def load_hyperparameters(self, hp: dict) -> None:  # noqa: B027 (optional to override)
        """Restore what ``hyperparameters`` returned (at least the step count)."""
