"""Evaluation of a fine-tune from the trainer's current weights: exact match by greedy generation,
eval loss, a few sample replies (``generate.py`` does the decoding)."""

from __future__ import annotations

import time

import torch

from ...data.batches import collate
from ...data.encode import Example
from ...hf.generate import eval_loss, greedy_generate, placement, same_answer
from ..ranks import Ranks


def evaluate(trainer, tok, examples: list[Example], *, stop_ids: list[int], pad_id: int,
             max_new_tokens: int, device: torch.device, answer_regex: str | None = None, samples: int = 3,
             batch: int = 32, ranks: Ranks | None = None) -> dict:
    """Exact match, eval loss and ``samples`` replies on ``examples`` with the trainer's weights (synced
    into its model, which runs eagerly: on the GPU when it fits in a quarter of the free memory).  With
    several ranks every rank calls it: each gathers the weights (a collective), rank 0 generates and the
    others take its results (``Ranks.share``)."""
    t0 = time.perf_counter()
    ranks = ranks or Ranks()
    trainer.sync_to_model(keep=ranks.main)      # the others hold one block at a time, not a model
    return ranks.share("evaluation", lambda: _evaluate(trainer.model, tok, examples, stop_ids=stop_ids,
                                                                   pad_id=pad_id, max_new_tokens=max_new_tokens,
                                                                   device=device, answer_regex=answer_regex,
                                                                   samples=samples, batch=batch, t0=t0))


def _evaluate(model, tok, examples: list[Example], *, stop_ids: list[int], pad_id: int, max_new_tokens: int,
              device: torch.device, answer_regex: str | None, samples: int, batch: int, t0: float) -> dict:
    where = placement(model, device)
    was_training = model.training
    model.eval()
    moved = model.to(where) if where.type != "cpu" else model
    try:
        asked = [e for e in examples if e.prompt_ids]
        replies = greedy_generate(moved, [list(e.prompt_ids) for e in asked], max_new_tokens=max_new_tokens,
                                  stop_ids=stop_ids, pad_id=pad_id, vocab=len(tok),
                                  batch_size=batch * (4 if where.type == "cuda" else 1))
        texts = [tok.decode(r.tokens, skip_special_tokens=True) for r in replies]
        hits = [same_answer(t, e.reference, answer_regex) for t, e in zip(texts, asked)]
        chunks = [examples[i:i + batch] for i in range(0, len(examples), batch)]
        rows = [collate(c, max(len(e) for e in c), pad_id) for c in chunks]     # as long as the longest, not seq
        loss, n_tok = eval_loss(moved, rows)
    finally:
        if where.type != "cpu":
            model.to("cpu")
        model.train(was_training)
    return {
        "exact_match": sum(hits) / len(hits) if hits else None, "n": len(hits),
        "stopped": sum(r.stopped for r in replies) / len(replies) if replies else None,
        "eval_loss": round(loss, 5), "eval_tokens": n_tok, "seconds": round(time.perf_counter() - t0, 2),
        "samples": [{"prompt": tok.decode(e.prompt_ids[-60:]), "reference": e.reference, "reply": t,
                     "stopped": r.stopped, "correct": h}
                    for e, t, r, h in list(zip(asked, texts, replies, hits))[:samples]],
    }


def describe(ev: dict, step: int) -> str:
    """One report line, then the samples."""
    em = "-" if ev["exact_match"] is None else f"{ev['exact_match']:.1%}"
    stopped = "" if ev["stopped"] is None else f", {ev['stopped']:.0%} of replies stopped"
    lines = [f"step {step}: exact match {em} on {ev['n']} eval examples, eval loss {ev['eval_loss']:.4f}{stopped} "
             f"({ev['seconds']:.0f} s)"]
    for s in ev["samples"]:
        mark = "ok " if s["correct"] else "bad"
        lines.append(f"  [{mark}] reply {s['reply']!r}  (reference {s['reference']!r})")
    return "\n".join(lines)
