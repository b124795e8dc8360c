"""Evaluation by generation: greedy decoding with a KV cache, exact match of the extracted answer,
and the eval loss, from a model's current weights.

Decoding runs a batch of prompts at once, left-padded (so every row's next token is at the last
column), with an ``attention_mask`` and positions counted from each row's first real token; the
first call fills the model's KV cache with the prompts, then each step feeds one token a row.  A row
stops at any of ``stop_ids`` (the eos, the chat template's end-of-turn token: ``data/encode.py``) or
after ``max_new_tokens``.  Prompts are sorted by length first, so a batch holds similar lengths.

The answer compared is, by default, the last number in the reply and in the reference (``1,234`` is
1234); ``answer_regex`` takes its first match instead (its first group, if it has one).  A text
without such an answer stands for itself, stripped (a bare reference ``B`` matches a reply whose
regex match is ``B``).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True, slots=True)
class Reply:
    tokens: list[int]       # without the stop token
    stopped: bool           # ended by a stop token (not by max_new_tokens)


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids, pad_id: int,
                    vocab: int | None = None, batch_size: int = 32) -> list[Reply]:
    """Greedy continuation of each prompt with the model's KV cache; ``vocab`` limits the choice to the
    tokenizer's ids (a model may have more embedding rows than its tokenizer has tokens)."""
    device = next(model.parameters()).device
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    # transformers 5 renamed the KV cache argument (and output) past_key_values -> cache
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Reply | None] = [None] * len(prompts)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        rows = [prompts[i] for i in idx]
        if any(not r for r in rows):
            raise ValueError("every prompt needs at least one token")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):
            ids[k, width - len(r):] = torch.tensor(r)
            mask[k, width - len(r):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        new = torch.empty((len(rows), 0), dtype=torch.long, device=device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        stopped = torch.zeros(len(rows), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = res.logits[:, -1, :vocab] if vocab else res.logits[:, -1]
            nxt = logits.argmax(-1)
            hit = torch.isin(nxt, stops) & ~done
            stopped |= hit
            nxt = nxt.masked_fill(done, pad_id)
            new = torch.cat([new, nxt[:, None]], dim=1)
            done |= hit
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True,
                        **{arg: res["cache"] if "cache" in res.keys() else res.past_key_values})
        stop_set = set(stop_ids)
        for k, (toks, hit) in enumerate(zip(new.tolist(), stopped.tolist())):
            end = next(t for t, v in enumerate(toks) if v in stop_set) if hit else len(toks)
            out[idx[k]] = Reply(toks[:end], hit)
    return out


def extract(text: str, pattern: str | None = None) -> str | None:
    """The answer in ``text``: the first match of ``pattern`` (its first group, if any), or the last
    number (commas between digits dropped); None when there is none."""
    if pattern is None:
        found = re.findall(NUMBER, re.sub(r"(?<=\d),(?=\d)", "", text))
        return found[-1] if found else None
    m = re.search(pattern, text)
    if m is None:
        return None
    return m.group(1) if m.groups() else m.group(0)


def answer(text: str, pattern: str | None = None) -> str:
    """What exact match compares: the extracted answer, or the whole stripped text when there is none."""
    found = extract(text, pattern)
    return text.strip() if found is None else found


def same_answer(reply: str, reference: str, pattern: str | None = None) -> bool:
    return answer(reply, pattern) == answer(reference, pattern)


@torch.no_grad()
def eval_loss(model, batches) -> tuple[float, int]:
    """(mean next-token loss, labelled tokens) over ``batches`` of ``input_ids`` / ``labels``
    (right-padded; labels -100 where nothing is scored)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for b in batches:
        ids, labels = b["input_ids"].to(device), b["labels"].to(device)
        logits = model(input_ids=ids).logits.float()     # right padding under causal attention: no mask needed
        target = labels[:, 1:]
        total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                                       ignore_index=-100, reduction="sum"))
        count += int((target != -100).sum())
    return total / max(count, 1), count


def placement(model, device: torch.device) -> torch.device:
    """Where to evaluate: the GPU when the model's weights take under a quarter of its free memory,
    else the CPU (the trainer's host store holds the real state; this is a copy)."""
    if device.type == "cuda":
        need = sum(p.numel() * p.element_size() for p in model.parameters())
        if need < torch.cuda.mem_get_info(device)[0] // 4:
            return device
    return torch.device("cpu")
