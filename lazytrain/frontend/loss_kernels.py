"""The loss head's per-chunk pointwise work as two functions a compiler can fuse: one read of the chunk's logits
in the forward, one read and one write in the backward.

``FusedLinearCrossEntropy`` (``loss_head.py``) forms each vocabulary chunk's logits with a matmul and then, in
eager mode, walks them with in-place kernels: the fp32 copy, the scale, the running maximum, the shift, the
exponential, the sum; in the backward the softmax, the target's ``- 1``, the row weights, the cast.  Each is a
pass over the chunk in device memory, and together they cost more than the chunk's matmuls
[ledger: loss-kernels-fused].  Here each direction's passes are one function of the
model-dtype product ``zb`` and the row figures, written without in-place updates or data-dependent indexing
(the target's column is compared with an iota, not scattered), so ``torch.compile`` fuses each into a single
kernel: the forward's row statistics from one read of ``zb``, the backward's ``d loss / d logits`` in the model
dtype from one read.  The arithmetic is the eager path's (fp32 after the product, the same formulas), only the
order of the reductions differs.

Why not always: eager, these functions would keep several fp32 copies of the chunk at once where the in-place
path keeps one (the head's ``bytes_per_logit`` counts that one); compiled, they keep less than it.  So the
runtime uses them when it compiles the blocks (``BlockProgram.compile``), and the eager path stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def _logits(zb: torch.Tensor, scale: float, softcap: float | None):
    """(the chunk's logits in fp32, or fp64 for an fp64 model; with a softcap also tanh of the capped argument)."""
    z = zb if zb.dtype in (torch.float32, torch.float64) else zb.float()
    if scale != 1.0:
        z = z * scale
    if not softcap:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


def chunk_stats(zb, rel, run_max, run_sum, target, scale: float, softcap: float | None):
    """The online log-sum-exp's step for one chunk: -> (running maximum, running sum, target logit) per row.
    ``rel``: each row's label minus the chunk's first column (inside the chunk where 0 <= rel < columns)."""
    z, _ = _logits(zb, scale, softcap)
    cols = z.shape[1]
    inside = (rel >= 0) & (rel < cols)
    hit = torch.arange(cols, device=z.device)[None, :] == rel[:, None]
    target = torch.where(inside, torch.where(hit, z, 0.0).sum(dim=1), target)
    new_max = torch.maximum(run_max, z.amax(dim=1))
    run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(z - new_max[:, None]).sum(dim=1)
    return new_max, run_sum, target


def chunk_grad(zb, rel, lse, row_grad, scale: float, softcap: float | None, out=None):
    """``d loss / d (features @ weight.T)`` of one chunk in the model dtype: row_grad * (softmax - onehot), through
    the softcap's and the scale's derivatives; written into ``out`` where given (the head passes ``zb`` itself,
    which it no longer needs: no second chunk, and the gradient keeps the product's aligned rows)."""
    z, t = _logits(zb, scale, softcap)
    cols = z.shape[1]
    hit = torch.arange(cols, device=z.device)[None, :] == rel[:, None]
    p = torch.exp(z - lse[:, None])
    p = torch.where(hit, p - 1.0, p) * row_grad[:, None]
    if softcap:
        p = p * (1.0 - t * t)
    if scale != 1.0:
        p = p * scale
    p = p.to(zb.dtype)
    return p if out is None else out.copy_(p)


@dataclass(frozen=True)
class LossKernels:
    """The two per-chunk functions the fused head calls instead of its in-place eager passes."""

    stats: Callable
    grad: Callable


def usable(kernels: LossKernels | None) -> LossKernels | None:
    """``kernels``, unless a Python dispatch mode is on (the CPU memory tracker of a calibration step,
    ``runtime/memtrack.py``): ``torch.compile`` refuses to run under one, and once refused it skips those
    functions for good, so the eager passes serve such a step (and the tracker sees their tensors)."""
    if kernels is None or is_in_torch_dispatch_mode():
        return None
    return kernels


def compiled_loss_kernels(backend: str = "inductor") -> LossKernels:
    """``chunk_stats`` and ``chunk_grad`` compiled with ``backend``.  Shapes are left to Dynamo: the first call
    specialises on the chunk's shape, the last (narrower) chunk or another micro-batch makes that dimension
    dynamic, so a head compiles a handful of times, not once per chunk."""
    return LossKernels(stats=torch.compile(chunk_stats, backend=backend, fullgraph=True),
                       grad=torch.compile(chunk_grad, backend=backend, fullgraph=True))
