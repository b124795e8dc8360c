"""GPU-updated streamed blocks (``Decisions.gpu_update``) for the Hybrid 8-bit AdamW: the block's state lives
in the host store like any streamed block's; for its update the runtime copies the load buffer and
``streamed_state`` to the GPU, ``step_streamed`` runs the device path (the resident blocks' Triton kernels) on
those copies, and the runtime copies them back.  The step counter stays the host block's, so a block may be
updated on the host one step (``flush``) and on the GPU the next."""

from __future__ import annotations

import copy

import torch

#: what a streamed block's state load copies beyond the load buffer (its state store copies them back)
STREAMED = ("lo", "own_master", "mq", "vq", "m_absmax", "v_absmax", "m32", "v32")


def device_tables(st, bs: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device kernels' index tables: per quantization block j (= its absmax index) its (buffer offset,
    numel, code offset), and the elements of the small (fp32-moment) tensors."""
    rows = [(off + k, min(bs, n_ - k), qo + k) for off, n_, _r, qo, _s in st.items for k in range(0, n_, bs)]
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(dev)
    idx = [torch.arange(off, off + n_, dtype=torch.int64) for off, n_, _s in st.small]
    return table, (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(dev)


class Streamed8bit:
    """The ``HostOptimizer`` methods for GPU-updated streamed blocks (``base.py``), mixed into
    ``Hybrid8bitAdamW``, whose ``_blocks``, ``_update``, ``_force_device``, ``host_only`` and ``_no_device`` they use.
    A host-only optimizer (stochastic-rounding master, 4-bit moments) has them too: the NVMe state tier writes
    ``streamed_state`` to its files and runs ``step_streamed`` on host copies; only a device copy is refused."""

    def streamed_state(self, block: int) -> dict[str, torch.Tensor]:
        st = self._blocks[block]
        return {k: getattr(st, k) for k in STREAMED if getattr(st, k) is not None}

    def set_streamed_state(self, block: int, state: dict[str, torch.Tensor], load: torch.Tensor | None = None) -> None:
        st = self._blocks[block]
        for k, t in state.items():
            setattr(st, k, t)
        if load is not None:
            st.load = load

    def step_streamed(self, block: int, grad: torch.Tensor, params: torch.Tensor, state: dict[str, torch.Tensor],
                      clip_coef: float = 1.0, lr: float | None = None) -> None:
        st = self._blocks[block]
        device = params.device.type != "cpu" or self._force_device
        if device and self.host_only:       # no device path (``hybrid8bit.NO_DEVICE_SR`` / ``NO_DEVICE_4BIT``)
            raise NotImplementedError(f"{self._no_device()} (block {block} is GPU-updated)")
        with st.lock:
            st.step += 1
            view = copy.copy(st)
            view.load = params
            for k, t in state.items():
                setattr(view, k, t)
            view.device = device
            if view.device:
                cached = getattr(st, "streamed_tables", None)
                if cached is None or cached[0].device != params.device:
                    cached = st.streamed_tables = device_tables(st, self.block_size, params.device)
                view.table, view.small_index = cached
            self._update(view, st.step, grad, clip_coef, lr)
