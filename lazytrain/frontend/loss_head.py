"""The loss head: the LM head's matmul and the next-token cross-entropy fused, the logits never whole.

A 152k vocabulary makes the logits the largest tensor of a step (Qwen2.5 at 32 x 1024 tokens: 18.6 GiB in
fp32, and as much again for their gradient).  ``FusedLinearCrossEntropy`` computes

    loss = sum over rows r with labels[r] != -100 of  logsumexp(z[r]) - z[r, labels[r]],
    z = cap * tanh(scale * (features @ weight.T + bias) / cap)      (cap: Gemma-2's softcap, else z = scale * ...)

over chunks of the vocabulary: every chunk takes *all* rows of the micro-batch and ``columns`` rows of the
weight, so the chunk's logits are ``rows x columns`` whatever the micro-batch.  Forward keeps a running
maximum and sum per row (the online log-sum-exp) and the target's logit, and saves only the rows' log-sum-exp
(4 bytes a token).  Backward recomputes each chunk's logits with the same shapes as the forward (so the
same values on the same device), turns them in place into ``grad * (softmax - onehot)``, and forms at once
that chunk's rows of the weight's (and bias's) gradient -- written into their slice, no accumulator -- and
its share of the features' gradient, summed over the chunks in fp32 (``rows x hidden``, far smaller than a
``vocab x hidden`` fp32 accumulator a row-chunked backward would need).  Exactly eager's math: logits in
the model dtype, upcast to fp32 before the softmax as Hugging Face's loss does, ignored rows (-100) count
nothing and get a zero gradient; the reduction (sum, then divided by the counted tokens of the whole step)
is the runtime's.

Cost (priced by the trace, chosen by ``compiler/loss_chunk.py``): FLOPs 2·N·V·d forward, 3x that backward
(the recompute plus the two gradient matmuls); GPU bytes: one chunk's logits at ``bytes_per_logit`` each
plus, per row, the fp32 feature-gradient accumulator, the model-dtype partial product and four fp32 row
statistics (``row_bytes``).

**Single pass** (``single_pass=True``, where the compiler finds the room): the loss is the last thing a step
computes and its own gradient seed is a scalar the backward only multiplies in, so the forward can form the
gradients at once, chunking the *rows* instead: each chunk of ``chunk_logits // V`` rows takes the whole
vocabulary, so its log-sum-exp is known before its ``d loss / d logits`` is formed from the same logits; the
chunk's feature gradient is one matmul over the whole vocabulary and its share of the weight's gradient is
added into one ``vocab x hidden`` fp32 accumulator (bf16 products accumulated in fp32, as one large matmul
over all rows would).  FLOPs 3 x 2·N·V·d in the forward and none in the backward, which scales the stored
gradients by the seed: the logits' recompute is gone (2·N·V·d, 2.4% of a Qwen2.5-7B step's model FLOPs).
GPU bytes: the accumulator (4 bytes a weight element, whose storage the model-dtype gradient then reuses) on
top of the chunk, from the head's forward to its backward, which the plan runs back to back (the backward's
scaled copy of the gradient is the plan's gradient buffer).
"""

from __future__ import annotations

import torch

from ..ir.graph import LOGIT_ROW_ALIGN, loss_chunk_columns, padded_row
from .loss_kernels import LossKernels, usable

#: the label of a position without loss (torch's cross_entropy ``ignore_index``), the one definition the
#: data, the tasks and the runtime share
IGNORE = -100

#: logits a chunk where the compiler chose none: one 1024-token sample of a 131k vocabulary [ledger: loss-head-share]
DEFAULT_CHUNK_LOGITS = 1 << 27

#: row statistics each fp32 a token: running maximum, running sum, target logit, then the log-sum-exp
ROW_STATS = 4

#: vocabulary columns of the eager single pass's sum of exponentials at a time (its only transient beyond the chunk)
SUM_COLUMNS = 1024


def bytes_per_logit(dtype: torch.dtype, softcap: float | None) -> int:
    """Peak GPU bytes per logit of a chunk: the model-dtype product next to its fp32 copy (the copy alone
    when the model is fp32), and with a softcap the fp32 derivative next to the fp32 softmax in backward."""
    size = torch.empty((), dtype=dtype).element_size()
    peak = 4 + (size if size < 4 else 0)
    return max(peak, 8) if softcap else peak


def row_bytes(dtype: torch.dtype, hidden: int) -> int:
    """GPU bytes per token besides the chunk: the fp32 feature-gradient accumulator, one chunk's
    model-dtype share of it, and the row statistics."""
    size = torch.empty((), dtype=dtype).element_size()
    return hidden * (4 + size) + ROW_STATS * 4


def _tensor_cores(dtype: torch.dtype) -> bool:
    """Do the head's GEMMs in ``dtype`` run on tensor cores (half precision), whose fast kernels want the
    vocabulary dimension and the logits' rows aligned (``_aligned``, ``_vocab_parts``)?"""
    return dtype.itemsize < 4


def _aligned(rows: int, cols: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised ``rows x cols`` matrix (``like``'s device, its dtype unless given) whose rows start
    ``padded_row(cols)`` elements apart in a half-precision dtype: the tensor-core GEMMs that write or read a
    chunk's logits keep their fast kernels for any vocabulary (``ir.graph.LOGIT_ROW_ALIGN``).  fp32 and fp64 stay
    packed (no tensor cores; and a BLAS's blocking follows the stride, so the CPU tests' sums stay as they were).
    The padding is zeroed: a GEMM may read a row past its last column and multiply it by zero (the CPU's bf16
    kernel does), which garbage there (a NaN) would not survive."""
    dtype = dtype or like.dtype
    wide = padded_row(cols) if _tensor_cores(dtype) else cols
    buf = torch.empty(rows, wide, dtype=dtype, device=like.device)
    if wide == cols:
        return buf
    buf[:, cols:].zero_()
    return buf[:, :cols]


def _vocab_parts(n: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """A GEMM over ``n`` vocabulary rows or columns as column ranges: in half precision the multiple of
    ``LOGIT_ROW_ALIGN`` first and the few left apart, since cuBLAS's fast kernels want that dimension aligned too,
    not only the rows' stride [ledger: logit-row-align]."""
    cut = n - n % LOGIT_ROW_ALIGN
    if not _tensor_cores(dtype) or cut in (0, n):
        return [(0, n)]
    return [(0, cut), (cut, n)]


def _product(f, w, b) -> torch.Tensor:
    """One chunk's ``features @ weight.T (+ bias)`` in the model dtype, in rows aligned as ``_aligned`` says."""
    out = _aligned(f.shape[0], w.shape[0], f)
    for lo, hi in _vocab_parts(w.shape[0], f.dtype):
        if b is None:
            torch.mm(f, w[lo:hi].t(), out=out[:, lo:hi])
        else:
            torch.addmm(b[lo:hi], f, w[lo:hi].t(), out=out[:, lo:hi])
    return out


def _features_grad(dz, w, out=None) -> torch.Tensor:
    """``dz @ w`` (the features' share of a chunk's gradient), summed over the vocabulary in ``_vocab_parts``."""
    (lo, hi), *rest = _vocab_parts(dz.shape[1], dz.dtype)
    out = torch.mm(dz[:, lo:hi], w[lo:hi], out=out)
    for lo, hi in rest:
        out.addmm_(dz[:, lo:hi], w[lo:hi])
    return out


def _weight_grad(dz, f, out, add: bool = False) -> None:
    """``dz.T @ f`` (the chunk's rows of the weight's gradient) into ``out``, or added into it, by ``_vocab_parts``."""
    for lo, hi in _vocab_parts(dz.shape[1], dz.dtype):
        if add:
            _add_product(out[lo:hi], dz[:, lo:hi].t(), f)
        else:
            torch.mm(dz[:, lo:hi].t(), f, out=out[lo:hi])


def _logits(f, w, b, scale: float, softcap: float | None) -> torch.Tensor:
    """One chunk's logits in fp32 (fp64 stays fp64): the model-dtype product is released at once."""
    z = _product(f, w, b)
    if z.dtype not in (torch.float32, torch.float64):
        z = z.float()
    if scale != 1.0:
        z.mul_(scale)
    if softcap:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _targets(labels: torch.Tensor, lo: int, hi: int):
    """(whether each row's target is in columns [lo, hi), its column in the chunk where it is, else 0):
    masks, not indices, so nothing waits for the device and shapes stay static (meta)."""
    inside = (labels >= lo) & (labels < hi)
    return inside, torch.where(inside, labels - lo, 0)[:, None]


def _softcap_derivative(z, softcap: float | None):
    """d cap*tanh(x/cap) / dx at the capped logits ``z`` (None without a softcap)."""
    return z.div(softcap).square_().neg_().add_(1) if softcap else None


def _finish_dz(p, inside, col, row_grad, deriv, scale: float, dtype: torch.dtype):
    """``d loss / d logits`` from the softmax ``p`` (overwritten): minus the target's one, times the rows' weights,
    the softcap's and the scale's derivatives, in ``dtype``."""
    p.scatter_add_(1, col, inside.to(p.dtype).neg_()[:, None])
    p.mul_(row_grad[:, None])
    if deriv is not None:
        p.mul_(deriv)
    if scale != 1.0:
        p.mul_(scale)
    if p.dtype == dtype:
        return p
    return _aligned(*p.shape, p, dtype).copy_(p)


def _chunk_dz(f, w, b, labels, lo: int, hi: int, lse, row_grad, scale: float, softcap: float | None):
    """One chunk's ``d loss / d logits`` in the model dtype, by in-place passes over one fp32 copy of its logits
    (the eager path; ``loss_kernels.chunk_grad`` is the same as one fusible function)."""
    z = _logits(f, w, b, scale, softcap)
    deriv = _softcap_derivative(z, softcap)
    p = z.sub_(lse[:, None]).exp_()          # softmax, in place of the logits
    inside, col = _targets(labels, lo, hi)
    return _finish_dz(p, inside, col, row_grad, deriv, scale, f.dtype)


def _rows_loss_dz(f, w, b, labels, scale: float, softcap: float | None, kernels):
    """(per-row loss, ``d loss_row / d logits`` in the model dtype) of a chunk of rows over the whole vocabulary:
    its log-sum-exp first, then the gradient from the same logits (the single pass)."""
    counted = labels != IGNORE
    if kernels is not None:
        zb = _product(f, w, b)
        stat = torch.float64 if zb.dtype == torch.float64 else torch.float32
        rows = zb.shape[0]
        m, s, t = kernels.stats(zb, labels, torch.full((rows,), float("-inf"), dtype=stat, device=zb.device),
                                torch.zeros(rows, dtype=stat, device=zb.device),
                                torch.zeros(rows, dtype=stat, device=zb.device), scale, softcap)
        lse = m + s.log()
        dz = kernels.grad(zb, labels, lse, counted.to(stat), scale, softcap, out=zb)
        return torch.where(counted, lse - t, 0.0), dz
    z = _logits(f, w, b, scale, softcap)
    deriv = _softcap_derivative(z, softcap)
    inside, col = _targets(labels, 0, z.shape[1])
    target = z.gather(1, col).squeeze(1)
    m = z.amax(dim=1)
    s = torch.zeros_like(m)
    for lo in range(0, z.shape[1], SUM_COLUMNS):     # exp(z - max) summed a slice at a time: z stays for the softmax
        s += torch.exp(z[:, lo:lo + SUM_COLUMNS] - m[:, None]).sum(dim=1)
    lse = m + s.log()
    p = z.sub_(lse[:, None]).exp_()          # the softmax in place, as eager's exp(log_softmax)
    return torch.where(counted, lse - target, 0.0), _finish_dz(p, inside, col, counted.to(p.dtype), deriv, scale,
                                                             f.dtype)


def _add_product(acc, a, b) -> None:
    """``acc += a @ b`` with ``a``, ``b`` in the model dtype and ``acc`` in fp32 (or their dtype): on CUDA one
    matmul that accumulates in fp32 and adds into ``acc`` itself; elsewhere through fp32 copies."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _into_own_storage(acc: torch.Tensor, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """``acc`` (fp32) cast to ``dtype`` (narrower) in the front of its own storage, a block of rows at a time (each
    cast into a small buffer first: a row block's target bytes overlap only rows already cast): no second
    ``vocab x hidden`` buffer at the end of the pass."""
    out = acc.view(-1).view(dtype)[:acc.numel()].view(acc.shape)
    for lo in range(0, acc.shape[0], rows):
        out[lo:lo + rows].copy_(acc[lo:lo + rows].to(dtype))
    return out


def _single_pass(ctx, feats, weight, bias, labels, rows: int, softcap, scale: float, kernels) -> torch.Tensor:
    """The loss, with the gradients formed on the way (saved on ``ctx`` for the backward to scale)."""
    need_f, need_w, need_b = ctx.needs_input_grad[:3]
    wide = torch.float64 if weight.dtype == torch.float64 else torch.float32
    gf = torch.empty_like(feats) if need_f else None
    gw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_w else None
    gb = torch.zeros(bias.shape, dtype=wide, device=bias.device) if need_b else None
    total = torch.zeros((), dtype=wide, device=feats.device)
    for lo in range(0, feats.shape[0], rows):
        f = feats[lo:lo + rows]
        loss, dz = _rows_loss_dz(f, weight, bias, labels[lo:lo + rows], scale, softcap, kernels)
        total += loss.sum()
        if need_f:
            _features_grad(dz, weight, out=gf[lo:lo + rows])
        if need_w:
            _weight_grad(dz, f, gw, add=True)
        if need_b:
            gb += dz.sum(dim=0, dtype=wide)
        del dz
    if gw is not None and gw.dtype != weight.dtype:
        gw = _into_own_storage(gw, weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    # saved as any saved tensor (the runtime's saved-tensor hooks hold them until the backward, which the plan runs
    # right after this forward; a graph kept with ``retain_graph`` can run it again)
    ctx.save_for_backward(gf, gw, gb)
    ctx.single_pass = True
    return total


class FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over counted rows of CE(features @ W.T + b, labels), one vocabulary chunk of logits at a time."""

    @staticmethod
    def forward(ctx, feats, weight, bias, labels, chunk_logits, softcap=None, scale=1.0, kernels=None,
                single_pass=False):
        rows, vocab = feats.shape[0], weight.shape[0]
        ctx.single_pass = False
        if single_pass and not feats.is_meta:
            return _single_pass(ctx, feats, weight, bias, labels, max(1, chunk_logits // padded_row(vocab)), softcap,
                                scale, usable(kernels))
        # shapes only (the cost measurement): FLOPs are linear in the columns, so one chunk counts the same
        cols = vocab if feats.is_meta else loss_chunk_columns(chunk_logits, rows, vocab)
        stat = torch.float64 if feats.dtype == torch.float64 else torch.float32
        run_max = torch.full((rows,), float("-inf"), dtype=stat, device=feats.device)
        run_sum = torch.zeros(rows, dtype=stat, device=feats.device)
        target = torch.zeros(rows, dtype=stat, device=feats.device)
        kernels = usable(kernels)
        for lo in range(0, vocab, cols):
            hi = min(vocab, lo + cols)
            if kernels is not None:
                zb = _product(feats, weight[lo:hi], None if bias is None else bias[lo:hi])
                run_max, run_sum, target = kernels.stats(zb, labels - lo, run_max, run_sum, target, scale, softcap)
                del zb
                continue
            z = _logits(feats, weight[lo:hi], None if bias is None else bias[lo:hi], scale, softcap)
            inside, col = _targets(labels, lo, hi)
            target = torch.where(inside, z.gather(1, col).squeeze(1), target)
            new_max = torch.maximum(run_max, z.amax(dim=1))
            run_sum.mul_(torch.exp(run_max - new_max)).add_(z.sub_(new_max[:, None]).exp_().sum(dim=1))
            run_max = new_max
            del z
        lse = run_max.add_(run_sum.log_())
        counted = labels != IGNORE
        ctx.save_for_backward(feats, weight, bias, labels, lse)
        ctx.cols, ctx.softcap, ctx.scale, ctx.kernels = cols, softcap, scale, kernels
        return torch.where(counted, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        if ctx.single_pass:     # the seed times the gradients the forward formed (the product in fp32)
            return (*(None if g is None else g * grad for g in ctx.saved_tensors), None, None, None, None, None, None)
        feats, weight, bias, labels, lse = ctx.saved_tensors
        need_f, need_w, need_b = ctx.needs_input_grad[:3]
        vocab, cols, softcap, scale = weight.shape[0], ctx.cols, ctx.softcap, ctx.scale
        row_grad = torch.where(labels != IGNORE, grad.to(lse.dtype), 0.0)     # d loss / d loss_row
        gf = None
        gw = torch.empty_like(weight) if need_w else None
        gb = torch.empty_like(bias) if need_b else None
        kernels = usable(ctx.kernels)
        for lo in range(0, vocab, cols):
            hi = min(vocab, lo + cols)
            if kernels is not None:
                zb = _product(feats, weight[lo:hi], None if bias is None else bias[lo:hi])
                dz = kernels.grad(zb, labels - lo, lse, row_grad, scale, softcap, out=zb)
                del zb
            else:
                dz = _chunk_dz(feats, weight[lo:hi], None if bias is None else bias[lo:hi], labels, lo, hi, lse,
                               row_grad, scale, softcap)
            if need_f:
                part = _features_grad(dz, weight[lo:hi])
                if gf is None:
                    gf = part if cols >= vocab else part.to(lse.dtype)
                else:
                    gf.add_(part)
                del part
            if need_w:
                _weight_grad(dz, feats, gw[lo:hi])
            if need_b:
                gb[lo:hi] = dz.sum(dim=0)
            del dz             # before the next chunk's logits exist
        gf = None if gf is None else gf.to(feats.dtype)
        return gf, gw, gb, None, None, None, None, None, None


def fused_next_token_loss(feats, weight, bias, labels, chunk_logits: int, softcap: float | None = None,
                          scale: float = 1.0, kernels: LossKernels | None = None, single_pass: bool = False):
    """(summed next-token CE, number of counted tokens) of features (b, s, d) against labels (b, s): the
    logits at position t are compared with the label at t + 1; ``scale``: logits multiplied by it first
    (Cohere, Granite); ``softcap``: logits = softcap * tanh(logits / softcap) (Gemma-2); ``kernels``: each
    chunk's pointwise work as compiled functions (``loss_kernels.py``) instead of the in-place eager passes;
    ``single_pass``: the gradients formed in the forward, chunked by rows (module docstring), where a backward
    follows (under ``no_grad`` the forward computes the loss alone)."""
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1).reshape(-1)
    flat = feats.reshape(-1, feats.shape[-1])
    loss = FusedLinearCrossEntropy.apply(flat, weight, bias, shifted, chunk_logits, softcap, scale, kernels,
                                         single_pass and torch.is_grad_enabled())
    return loss, (shifted != IGNORE).sum()
