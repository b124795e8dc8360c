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
    ``Hybrid8bitAdamW``, whose ``_blocks``, ``_update``, ``_force_device`` and ``stochastic_rounding`` they use."""

    def streamed_state(self, block: int) -> dict[str, torch.Tensor]:
        if self.stochastic_rounding:    # no device path for it (``hybrid8bit.NO_DEVICE_SR``)
            raise NotImplementedError("the stochastic-rounding master (optimizer hybrid8bit-sr) updates on the "
                                      "host only")
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
        with st.lock:
            st.step += 1
            view = copy.copy(st)
            view.load = params
            for k, t in state.items():
                setattr(view, k, t)
            view.device = params.device.type != "cpu" or self._force_device
            if view.device:
                cached = getattr(st, "streamed_tables", None)
                if cached is None or cached[0].device != params.device:
                    cached = st.streamed_tables = device_tables(st, self.block_size, params.device)
                view.table, view.small_index = cached
            self._update(view, st.step, grad, clip_coef, lr)
