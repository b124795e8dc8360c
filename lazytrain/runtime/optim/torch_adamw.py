"""fp32 AdamW on the host: a master copy per block and ``torch.optim.AdamW`` doing the math.

The reference optimizer: every update is ``torch.optim.AdamW`` (fused CPU kernel where this torch
has one, else foreach), so results equal plain PyTorch training bit-for-bit.  Per block the optimizer
owns an fp32 master (or, when the runtime's load buffer is itself fp32, uses that buffer as the
master) and fp32 ``exp_avg`` / ``exp_avg_sq``; the block is cut into chunks of ``chunk_numel``
elements, each a separate optimizer parameter (a view of the flat master), so the fp32 copy of
the gradient is one reusable chunk-sized scratch buffer rather than a whole block.  AdamW is
elementwise, so chunking changes no result.

Host bytes per parameter: load buffer (2 for bf16) + gradient buffer (2 for bf16) + master (4, or 0
when the load buffer is the fp32 master) + exp_avg and exp_avg_sq (8) = 16.

GPU-resident blocks (a load buffer on a CUDA device, see ``base.py``): master, moments and step
counts live on that device and one ``torch.optim.AdamW(fused=True)`` call updates the whole block on
the current stream (with a clip coefficient, one call per chunk on a chunk-sized scaled copy of the
gradient, so the transient costs 4 B x ``chunk_numel``, not a whole block); the master is then cast
into the load buffer on the same stream.  Nothing reads device values back, so ``step`` queues work
without synchronising.  The chunking, and hence the state's shapes, are those of host blocks, and
``master`` / ``state_tensors`` return CPU tensors: checkpoints do not depend on placement.
"""

from __future__ import annotations

import threading

import torch

from .base import HostOptimizer, Segment


def _fused_supported() -> bool:
    try:
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


class _Block:
    __slots__ = ("load", "master", "opt", "chunks", "lock", "device")

    def __init__(self, load, master, opt, chunks, device=False):
        self.load, self.master, self.opt, self.chunks = load, master, opt, chunks
        self.lock = threading.Lock()
        self.device = device  # a GPU-resident block: master and state on the load buffer's device

    def sync(self) -> None:
        """Wait for a CUDA block's queued work (any stream): checkpoint access runs between steps."""
        if self.master.is_cuda:
            torch.cuda.synchronize(self.master.device)


class TorchAdamW(HostOptimizer):
    """fp32 AdamW with decoupled weight decay, matching ``torch.optim.AdamW`` (see module docstring)."""

    def __init__(
        self,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        chunk_numel: int = 1 << 22,
        param_bytes: int = 2,
        grad_bytes: int = 2,
    ):
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.max_grad_norm = max_grad_norm
        self.chunk_numel = chunk_numel
        self.fused = _fused_supported()
        self._param_bytes, self._grad_bytes = param_bytes, grad_bytes
        self._blocks: dict[int, _Block] = {}
        self._flat_state: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._step_count: dict[int, int] = {}
        self._force_device = False  # test hook: treat CPU load buffers as device blocks

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def host_bytes_per_param(self) -> float:
        """Computed from what is allocated (before any ``setup``: the bf16-buffer case)."""
        host = [b for b in self._blocks.values() if not b.device]  # device blocks keep no host memory
        if not host:
            return float(self._param_bytes + self._grad_bytes + 4 + 8)
        numel = sum(b.master.numel() for b in host)
        owned = 0
        for b in host:
            if b.master.data_ptr() != b.load.data_ptr():
                owned += b.master.numel() * 4
            owned += 2 * b.master.numel() * 4  # exp_avg, exp_avg_sq
        load = sum(b.load.numel() * b.load.element_size() for b in host)
        return (load + owned) / numel + self._grad_bytes

    def device_bytes_per_param(self, param_bytes: int | None = None) -> float:
        """Device memory per parameter kept for a GPU-resident block beyond its load buffer: fp32
        exp_avg and exp_avg_sq (8) + an fp32 master (4) unless the load buffer is fp32 itself
        (``param_bytes`` 4).  With ``param_bytes`` (or before any device block exists: the
        constructor's ``param_bytes``) the exact figure for that buffer size; with no argument after
        ``setup``, measured over the device blocks.  Per-chunk step counters (4 B per chunk) and the
        clip path's transient chunk (4 B x ``chunk_numel``) are left out."""
        dev = [b for b in self._blocks.values() if b.device]
        if param_bytes is not None or not dev:
            pb = self._param_bytes if param_bytes is None else param_bytes
            return 8.0 + (0.0 if pb == 4 else 4.0)
        numel = sum(b.master.numel() for b in dev)
        owned = sum(b.master.numel() * (4 if b.master.data_ptr() != b.load.data_ptr() else 0) for b in dev)
        return (owned + 8 * numel) / numel

    def _make_opt(self, params, fused: bool):
        kw = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, fused=True, **kw) if fused else torch.optim.AdamW(params, foreach=True, **kw)

    # -- HostOptimizer -------------------------------------------------------------------------------
    def setup(self, block: int, init: torch.Tensor, load_buffer: torch.Tensor, segments: list[Segment]) -> None:
        init = init.reshape(-1)
        dev = load_buffer.device
        device = dev.type != "cpu" or self._force_device
        if load_buffer.dtype == torch.float32:
            master = load_buffer
            if init.data_ptr() != master.data_ptr():
                master.copy_(init)
        else:
            master = init.to(device=dev, dtype=torch.float32, copy=True)
            load_buffer.copy_(master)
        n = master.numel()
        # state lives in preallocated flat tensors so checkpoints are a few copies (and a streamed block's
        # state load too); per chunk a step count, a view of ``steps`` (fused CUDA wants it on the device)
        exp_avg, exp_avg_sq = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        steps = torch.zeros(-(-n // self.chunk_numel), dtype=torch.float32, device=dev)
        self._blocks[block] = self._bind(load_buffer, master, exp_avg, exp_avg_sq, steps, device)
        self._flat_state[block] = (exp_avg, exp_avg_sq, steps)
        self._step_count[block] = 0

    def _bind(self, load, master, exp_avg, exp_avg_sq, steps, device: bool) -> _Block:
        """A block over these tensors: its chunks (views of ``master``) and their ``torch.optim.AdamW``."""
        chunks = [master[i : i + self.chunk_numel] for i in range(0, master.numel(), self.chunk_numel)]
        # CUDA always has the fused kernel; on the CPU it depends on the build (checked at init)
        opt = self._make_opt(chunks, fused=self.fused or master.device.type == "cuda")
        for i, c in enumerate(chunks):
            lo, hi = i * self.chunk_numel, i * self.chunk_numel + c.numel()
            opt.state[c] = {"step": steps[i], "exp_avg": exp_avg[lo:hi], "exp_avg_sq": exp_avg_sq[lo:hi]}
        return _Block(load, master, opt, chunks, device)

    # -- GPU-updated streamed blocks (``base.py``) ---------------------------------------------------
    def streamed_state(self, block: int) -> dict[str, torch.Tensor]:
        b = self._blocks[block]
        exp_avg, exp_avg_sq, steps = self._flat_state[block]
        own = {} if b.master is b.load else {"master": b.master}
        return {**own, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "steps": steps}

    def set_streamed_state(self, block: int, state: dict[str, torch.Tensor], load: torch.Tensor | None = None) -> None:
        b = self._blocks[block]
        state = {**self.streamed_state(block), **state}     # (the keys not given stay as they are)
        load = b.load if load is None else load
        master = state.get("master", load)      # (an fp32 load buffer is its own master)
        self._flat_state[block] = (state["exp_avg"], state["exp_avg_sq"], state["steps"])
        if master.numel() and state["exp_avg"].numel():
            self._blocks[block] = self._bind(load, master, state["exp_avg"], state["exp_avg_sq"], state["steps"],
                                             b.device)
        else:       # state only in its files (``runtime/nvme_state.py``): no chunks to update
            self._blocks[block] = _Block(load, master, None, [], b.device)

    def step_streamed(self, block: int, grad: torch.Tensor, params: torch.Tensor, state: dict[str, torch.Tensor],
                      clip_coef: float = 1.0, lr: float | None = None) -> None:
        b = self._blocks[block]
        with b.lock:
            view = self._bind(params, state.get("master", params), state["exp_avg"], state["exp_avg_sq"],
                              state["steps"], params.device.type != "cpu" or self._force_device)
            self._step(view, grad.reshape(-1), clip_coef, lr)
            self._step_count[block] += 1

    def step(self, block: int, grad: torch.Tensor, clip_coef: float = 1.0, lr: float | None = None) -> None:
        b = self._blocks[block]
        with b.lock:
            self._step(b, grad.reshape(-1), clip_coef, lr)
            self._step_count[block] += 1

    def _step(self, b: _Block, grad: torch.Tensor, clip_coef: float, lr: float | None) -> None:
        for group in b.opt.param_groups:  # follow lr schedules set on this object
            group.update(
                lr=self.lr if lr is None else lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
            )
        if b.device:
            self._step_device(b, grad, clip_coef)
            return
        scratch = torch.empty(min(self.chunk_numel, b.master.numel()), dtype=torch.float32)
        for i, c in enumerate(b.chunks):
            off = i * self.chunk_numel
            g = scratch[: c.numel()]
            g.copy_(grad[off : off + c.numel()])
            if clip_coef != 1.0:
                g.mul_(clip_coef)
            c.grad = g
            b.opt.step()  # only this chunk has a gradient, so only it is updated
            c.grad = None
            if b.load is not b.master:
                b.load[off : off + c.numel()].copy_(c)

    @staticmethod
    def _step_device(b: _Block, grad: torch.Tensor, clip_coef: float) -> None:
        """Queue a device block's update on the current stream; reads nothing back to the host."""
        if grad.dtype != torch.float32:  # the fused kernel wants grads of the params' dtype
            grad = grad.to(torch.float32)
        spans = [(i * b.chunks[0].numel(), c) for i, c in enumerate(b.chunks)]
        if clip_coef == 1.0:  # gradient views, the whole block in one fused call
            for off, c in spans:
                c.grad = grad[off : off + c.numel()]
            b.opt.step()
            for _, c in spans:
                c.grad = None
        else:  # scaled copies (as the host path's g.mul_(clip_coef)), a chunk at a time
            for off, c in spans:
                c.grad = torch.mul(grad[off : off + c.numel()], clip_coef)
                b.opt.step()  # only this chunk has a gradient, so only it is updated
                c.grad = None
        if b.load is not b.master:
            b.load.copy_(b.master)

    def master(self, block: int) -> torch.Tensor:
        """The fp32 master: a view for host blocks, a CPU copy for device blocks."""
        b = self._blocks[block]
        if b.device:
            b.sync()
            return b.master.to("cpu", copy=True)
        return b.master

    def state_tensors(self, block: int) -> dict[str, torch.Tensor]:
        b = self._blocks[block]
        exp_avg, exp_avg_sq, _ = self._flat_state[block]
        b.sync()
        steps = torch.stack([b.opt.state[c]["step"] for c in b.chunks]).to("cpu", copy=True)
        return {
            "master": b.master.to("cpu", copy=True),
            "exp_avg": exp_avg.to("cpu", copy=True),
            "exp_avg_sq": exp_avg_sq.to("cpu", copy=True),
            "step": steps,
        }

    def load_state_tensors(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        b = self._blocks[block]
        exp_avg, exp_avg_sq, _ = self._flat_state[block]
        with b.lock:
            b.master.copy_(tensors["master"])
            exp_avg.copy_(tensors["exp_avg"])
            exp_avg_sq.copy_(tensors["exp_avg_sq"])
            for c, s in zip(b.chunks, tensors["step"]):
                b.opt.state[c]["step"].copy_(s)
            if b.load is not b.master:
                b.load.copy_(b.master)
            self._step_count[block] = int(tensors["step"].max().item()) if len(b.chunks) else 0
            b.sync()  # the next step may run on another stream

    def hyperparameters(self) -> dict:
        return {
            "name": "TorchAdamW",
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
            "fused": self.fused,
            "step": max(self._step_count.values(), default=0),
        }

    def load_hyperparameters(self, hp: dict) -> None:
        self.lr = hp.get("lr", self.lr)
        self.betas = tuple(hp.get("betas", self.betas))
        self.eps = hp.get("eps", self.eps)
        self.weight_decay = hp.get("weight_decay", self.weight_decay)
        self.max_grad_norm = hp.get("max_grad_norm", self.max_grad_norm)
        for b in self._blocks.values():
            for g in b.opt.param_groups if b.opt is not None else ():
                g.update(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
