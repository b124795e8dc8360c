"""Eager PyTorch training beside a plan's ``Trainer``: the reference the equivalence tests compare with.

Both sides take the same batches; eager runs ``torch.optim.AdamW`` (no weight decay) with the global
gradient norm clipped as the trainer's optimizer clips it.  Losses must agree to rtol 1e-5 and gradient
norms to 1e-4 at every step, parameters to rtol 1e-5 at the end (fp32 on the CPU: rounding only).
"""

from __future__ import annotations

import torch


def step_beside_eager(trainer, ref: torch.nn.Module, batches, eager_loss, *, lr: float, eps: float,
                      clip: float | None = 1.0, params=None, fused: bool | None = None) -> None:
    """One trainer step and one eager step per ``(ids, labels)``; ``eager_loss(ref, ids, labels)`` is the
    reference loss; ``params``: the parameters eager trains (default all of ``ref``'s)."""
    params = list(ref.parameters()) if params is None else list(params)
    opt = torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=0.0, fused=fused)
    for ids, labels in batches:
        stats = trainer.step({"input_ids": ids, "labels": labels})
        loss = eager_loss(ref, ids, labels)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
        opt.step()
        torch.testing.assert_close(stats.loss, loss.item(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats.grad_norm, norm.item(), rtol=1e-4, atol=1e-6)
        assert stats.tokens == int((labels[:, 1:] != -100).sum()) and not stats.skipped


def assert_same_parameters(model: torch.nn.Module, ref: torch.nn.Module, atol: float = 1e-6) -> None:
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def random_batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 1):
    """``steps`` batches of random ids, each its own labels."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        yield ids, ids
