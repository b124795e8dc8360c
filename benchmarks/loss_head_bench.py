"""The fused loss head alone: wall time of its forward and backward, eager passes against the fused chunk kernels,
and the single pass (gradients formed in the forward, no logits recomputed) with the fused kernels.

    python benchmarks/loss_head_bench.py [--hidden 2048] [--vocab 151936] [--tokens 32768,8192] \
        [--chunk-logits 134217728]

Random bf16 features and weight on the GPU (qwen2.5-3b's head by default), each variant run five times after its
kernels are compiled, the last run reported, with ``torch.cuda.synchronize`` around each half so the figure is
what the step waits for.  The runtime uses the fused kernels when it compiles the blocks (``loss_kernels.py``).
"""

from __future__ import annotations

import argparse
import time

import torch

from lazytrain.frontend.loss_head import fused_next_token_loss
from lazytrain.frontend.loss_kernels import compiled_loss_kernels


def time_head(tokens: int, hidden: int, vocab: int, chunk_logits: int, kernels, single_pass: bool = False,
              repeats: int = 5) -> tuple[float, float]:
    """(forward s, backward s) of the last of ``repeats`` runs."""
    feats = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    for _ in range(repeats):
        feats.grad = weight.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _ = fused_next_token_loss(feats, weight, None, labels, chunk_logits, kernels=kernels,
                                        single_pass=single_pass)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", default="32768,8192")
    ap.add_argument("--chunk-logits", type=int, default=1 << 27)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loss_head_bench: needs a CUDA GPU")
    fused = compiled_loss_kernels()
    print(f"hidden {args.hidden}, vocab {args.vocab}, {args.chunk_logits} logits a chunk")
    print("| tokens | eager passes ms (forward / backward) | fused kernels ms | single pass, fused ms | "
          "single / fused (sum) |\n| --- | --- | --- | --- | --- |")
    for tokens in (int(t) for t in args.tokens.split(",")):
        eager = time_head(tokens, args.hidden, args.vocab, args.chunk_logits, None)
        fast = time_head(tokens, args.hidden, args.vocab, args.chunk_logits, fused)
        one = time_head(tokens, args.hidden, args.vocab, args.chunk_logits, fused, single_pass=True)
        ms = [f"{a * 1e3:.1f} / {b * 1e3:.1f}" for a, b in (eager, fast, one)]
        print(f"| {tokens:,} | {ms[0]} | {ms[1]} | {ms[2]} | {sum(one) / sum(fast):.3f} |")


if __name__ == "__main__":
    main()
