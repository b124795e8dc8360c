"""Global gradient-norm clipping, folded into the optimizer step (``docs/architecture.md``, "The update path").

Each block's gradient squared norm is reduced where the gradient is produced (on the GPU, right after
that block's backward), so no extra pass over host memory is needed; :class:`GradNormTracker` sums
the per-block values, and at the end of backward the global norm gives one clip coefficient that
every block's ``HostOptimizer.step`` applies while it reads the gradient.

The coefficient is the one ``torch.nn.utils.clip_grad_norm_`` uses, ``min(1, max / (norm + 1e-6))``,
so a clipped LazyTrain step equals ``clip_grad_norm_`` followed by AdamW (to fp32 rounding).
"""

from __future__ import annotations

import math
import threading

import torch

#: abort after this many consecutive steps with a non-finite gradient norm
MAX_CONSECUTIVE_NONFINITE = 3


class NonFiniteGradError(RuntimeError):
    """Raised after ``MAX_CONSECUTIVE_NONFINITE`` consecutive steps with a NaN/inf gradient norm."""


def clip_coefficient(total_sq_norm: float, max_grad_norm: float | None) -> float:
    """The factor to multiply gradients by: ``min(1, max_grad_norm / (sqrt(total_sq_norm) + 1e-6))``.

    Returns 1.0 when ``max_grad_norm`` is None.  A non-finite norm is the caller's business
    (:class:`GradNormTracker` skips such steps); here it raises ``ValueError`` so it cannot slip
    into an update silently.
    """
    if max_grad_norm is None:
        return 1.0
    if not math.isfinite(total_sq_norm) or total_sq_norm < 0:
        raise ValueError(f"gradient squared norm is {total_sq_norm}: cannot clip")
    return min(1.0, max_grad_norm / (math.sqrt(total_sq_norm) + 1e-6))


#: elements per partial sum (summed in double) of a host tensor's squared norm [ledger: host-norm-chunk]
HOST_NORM_CHUNK = 1 << 16


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``sum(t**2)`` as a 0-d tensor on ``t``'s device, to about 1e-8 relative however large ``t`` is.

    On a GPU that is ``vector_norm(t)**2`` (a tree reduction).  On the CPU ``vector_norm`` of an fp32 tensor
    accumulates in fp32 along long runs: 2.4e-3 relative error at 25M elements (one layer of Qwen3-Next), which
    made a step's gradient norm, hence its clip coefficient, differ from eager PyTorch's.  There, one BLAS dot
    per chunk of ``HOST_NORM_CHUNK`` elements (a chunk of another dtype in fp64), summed in double."""
    if t.device.type != "cpu":
        return torch.linalg.vector_norm(t).square()
    chunks = t.reshape(-1).split(HOST_NORM_CHUNK)
    if t.dtype not in (torch.float32, torch.float64):
        chunks = (c.double() for c in chunks)
    return torch.tensor(math.fsum(float(torch.dot(c, c)) for c in chunks), dtype=torch.float64)


class GradNormTracker:
    """Accumulates per-block squared gradient norms over one step and decides what the step does.

    Usage per training step::

        tracker.begin_step()
        for block in backward_order:
            tracker.add(block, sq_norm_of_block_grad)      # float or 0-d tensor, any thread
        coef = tracker.finish_step()                      # None: skip the update of every block
        if coef is not None:
            for block in blocks: opt.step(block, grad[block], coef)

    ``finish_step`` returns ``None`` for a non-finite norm (the step is skipped and counted) and
    raises :class:`NonFiniteGradError` on the ``MAX_CONSECUTIVE_NONFINITE``-th such step in a row.
    Adding the same block twice in one step is an error (it would double-count its norm).
    """

    def __init__(self, max_grad_norm: float | None = None, max_consecutive_nonfinite: int = MAX_CONSECUTIVE_NONFINITE):
        self.max_grad_norm = max_grad_norm
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.consecutive_nonfinite = 0
        self.total_nonfinite = 0
        self.last_norm: float | None = None
        self._sq: dict[int, float] = {}
        self._lock = threading.Lock()

    def begin_step(self) -> None:
        with self._lock:
            self._sq = {}

    def add(self, block: int, sq_norm) -> None:
        value = float(sq_norm)  # a 0-d tensor syncs here, once per block
        with self._lock:
            if block in self._sq:
                raise ValueError(f"block {block} added twice in one step")
            self._sq[block] = value

    def total_sq_norm(self) -> float:
        with self._lock:
            return math.fsum(self._sq.values())

    def global_norm(self) -> float:
        return math.sqrt(self.total_sq_norm())

    def finish_step(self) -> float | None:
        """The clip coefficient for this step, or None if the step must be skipped."""
        sq = self.total_sq_norm()
        norm = math.sqrt(sq) if sq >= 0 else math.nan
        self.last_norm = norm
        if not math.isfinite(norm):
            self.consecutive_nonfinite += 1
            self.total_nonfinite += 1
            if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
                raise NonFiniteGradError(
                    f"gradient norm is {norm} for {self.consecutive_nonfinite} consecutive steps "
                    f"({self.total_nonfinite} non-finite in total)"
                )
            return None
        self.consecutive_nonfinite = 0
        return clip_coefficient(sq, self.max_grad_norm)
