"""The loss head's GEMMs and chunk kernels one at a time, at a vocabulary that is a multiple of 8 and one that is not:
which of them leaves cuBLAS's fast kernels, and whether padding the logits' rows brings it back.

    python benchmarks/head_gemms.py [--shapes 768:50257,768:50304,4096:128257,4096:128256]

For each ``hidden:vocab``, one single-pass chunk (2^27 logits: ``2^27 // padded_row(vocab)`` rows) of bf16 operands on
the GPU; each op's mean over 20 runs after 3, CUDA events around them.  "packed": the logits' rows ``vocab`` elements
apart; "padded": ``padded_row(vocab)`` apart (``loss_head._aligned``).  Measured on the H200 (2026-12-03): padding
made the weight-gradient GEMM fast again but not the product or the feature gradient, whose vocabulary dimension
itself must be a multiple of 8 -- hence ``loss_head._vocab_parts``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lazytrain.frontend.loss_kernels import compiled_loss_kernels
from lazytrain.ir.graph import padded_row

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_kernels import timed  # noqa: E402 - a sibling script's timer


def mean_ms(fn) -> float:
    """Milliseconds of ``fn``, the mean over 20 runs after 3 (``sdpa_kernels.timed``)."""
    return timed(fn, iters=20) * 1e3


def probe(hidden: int, vocab: int, kernels) -> dict[str, float]:
    rows = (1 << 27) // padded_row(vocab)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    f = torch.randn(rows, hidden, **bf16)
    w = torch.randn(vocab, hidden, **bf16) * 0.02
    padded = torch.empty(rows, padded_row(vocab), **bf16)[:, :vocab]
    packed = torch.empty(rows, vocab, **bf16)
    acc = torch.zeros(vocab, hidden, device="cuda", dtype=torch.float32)
    gf = torch.empty(rows, hidden, **bf16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    lse, row_grad = torch.zeros(rows, device="cuda"), torch.ones(rows, device="cuda")
    out = {}
    for name, z in (("packed", packed), ("padded", padded)):
        out[f"product {name}"] = mean_ms(lambda z=z: torch.mm(f, w.t(), out=z))
        out[f"feature grad {name}"] = mean_ms(lambda z=z: torch.mm(z, w, out=gf))
        out[f"weight grad {name}"] = mean_ms(lambda z=z: torch.addmm(acc, z.t(), f, out_dtype=torch.float32, out=acc))
    out["stats kernel padded"] = mean_ms(lambda: kernels.stats(
        padded, labels, torch.full((rows,), -1e30, device="cuda"), torch.zeros(rows, device="cuda"),
        torch.zeros(rows, device="cuda"), 1.0, None))
    out["grad kernel padded, in place"] = mean_ms(lambda: kernels.grad(padded, labels, lse, row_grad, 1.0, None,
                                                                       out=padded))
    out["grad kernel packed"] = mean_ms(lambda: kernels.grad(packed, labels, lse, row_grad, 1.0, None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="768:50257,768:50304,4096:128257,4096:128256")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("head_gemms: needs a CUDA GPU")
    kernels = compiled_loss_kernels()
    for shape in args.shapes.split(","):
        hidden, vocab = (int(x) for x in shape.split(":"))
        res = probe(hidden, vocab, kernels)
        print(f"hidden {hidden}, vocab {vocab}, {(1 << 27) // padded_row(vocab)} rows: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
