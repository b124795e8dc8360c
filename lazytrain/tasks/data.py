"""Batches for training, and exact-match scoring by batched greedy decoding.

A sequence is ``<bos> Q: ... A: <worked answer> <eos>``, right-padded with ``<pad>`` to ``seq_len``.
``labels`` sit at the same positions as ``input_ids`` (the Hugging Face convention): the loss
compares ``logits[:, t]`` with ``labels[:, t + 1]``, as ``shifted_cross_entropy`` does. By default
only the worked answer and its eos carry a label; the prompt and the padding are ``IGNORE``.
Exact match decodes the worked answer greedily and compares the number it ends with.

Drills (``drills=True``): the padding after a row's word problem is filled with bare worked answers
of other train problems, ``<bos> 19+18=37 <eos>``, each whole and labelled (but for its bos).
The word problem still starts every row at position 0 and a causal model never lets it see what
follows, so its own training signal is unchanged; the drills add arithmetic practice, the part of
the task that is learned last, in tokens the step computes anyway (~15% of the "tiny" rows are
padding).  The drills come from their own seeded stream of train problems (never an eval one).

Decoding keeps the training layout (right padding, causal model) and tracks one position per row:
each step runs the model on the batch and reads each row's logits at its own last token. This is exact
for any causal ``generate_fn``, since no row ever sees a pad before its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..frontend.loss_head import IGNORE
from .arith import Difficulty, Example, drill_examples, get_difficulty, train_examples
from .tokenizer import CharTokenizer

GenerateFn = Callable[[torch.Tensor], torch.Tensor]  # input_ids [B, T] int64 -> logits [B, T, V]


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with pad_id
    labels: torch.Tensor     # [B, T] int64, IGNORE where there is no loss


def encode_example(ex: Example, tokenizer: CharTokenizer) -> tuple[list[int], int]:
    """Token ids of the whole sequence, and how many of them (bos + prompt) come before the answer."""
    prompt = tokenizer.encode(ex.prompt, bos=True)
    return prompt + tokenizer.encode(ex.solution, eos=True), len(prompt)


def collate(examples: Sequence[Example], seq_len: int, *, tokenizer: CharTokenizer | None = None,
            loss_on_prompt: bool = False, drills: Drills | None = None) -> Batch:
    """Fixed ``[len(examples), seq_len]`` tensors; ``loss_on_prompt`` puts labels on every real token;
    ``drills`` fills each row's padding (see the module docstring)."""
    tok = tokenizer or CharTokenizer()
    input_ids = torch.full((len(examples), seq_len), tok.pad_id, dtype=torch.int64)
    labels = torch.full((len(examples), seq_len), IGNORE, dtype=torch.int64)
    for row, ex in enumerate(examples):
        ids, n_prompt = encode_example(ex, tok)
        if len(ids) > seq_len:
            raise ValueError(f"example of {len(ids)} tokens does not fit seq_len={seq_len}: {ex.text!r}")
        input_ids[row, :len(ids)] = torch.tensor(ids)
        first = 0 if loss_on_prompt else n_prompt
        labels[row, first:len(ids)] = input_ids[row, first:len(ids)]
        if drills is not None:
            _fill_drills(input_ids[row], labels[row], len(ids), drills)
    return Batch(input_ids=input_ids, labels=labels)


class Drills:
    """Bare worked answers (``<bos> 19+18=37 <eos>``) to fill rows' padding with, in stream order: a
    drill that does not fit the space left waits for the next row, so none is cut and the batches are
    a fixed function of the seed."""

    def __init__(self, examples: Iterator[Example], tokenizer: CharTokenizer):
        self._examples, self._tok = examples, tokenizer
        self._next: list[int] | None = None

    def peek(self) -> list[int]:
        if self._next is None:
            self._next = self._tok.encode(next(self._examples).solution, bos=True, eos=True)
        return self._next

    def take(self) -> list[int]:
        ids, self._next = self.peek(), None
        return ids


def _fill_drills(input_ids: torch.Tensor, labels: torch.Tensor, used: int, drills: Drills) -> None:
    """Drills after the row's first ``used`` tokens while whole ones fit; no label on a drill's bos (what
    follows an eos is never generated)."""
    while used + len(drills.peek()) <= len(input_ids):
        ids = drills.take()
        input_ids[used:used + len(ids)] = torch.tensor(ids)
        labels[used + 1:used + len(ids)] = input_ids[used + 1:used + len(ids)]
        used += len(ids)


def train_batches(batch_size: int, *, difficulty: str | Difficulty = "easy", seed: int = 0,
                  seq_len: int | None = None, tokenizer: CharTokenizer | None = None,
                  loss_on_prompt: bool = False, drills: bool = False) -> Iterator[Batch]:
    """Endless train batches, the same sequence for the same arguments; ``seq_len`` defaults to the preset's;
    ``drills`` fills the rows' padding with bare worked answers (see the module docstring)."""
    d = get_difficulty(difficulty)
    tok = tokenizer or CharTokenizer()
    stream = train_examples(d, seed=seed)
    filler = Drills(drill_examples(d, seed=seed), tok) if drills else None
    while True:
        examples = [next(stream) for _ in range(batch_size)]
        yield collate(examples, seq_len or d.seq_len, tokenizer=tok, loss_on_prompt=loss_on_prompt, drills=filler)


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over labelled positions: ``logits[:, t]`` predicts ``labels[:, t + 1]``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


@torch.no_grad()
def greedy_generate(model_fn: GenerateFn, prompt_ids: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
                    *, eos_id: int = CharTokenizer.eos_id, pad_id: int = CharTokenizer.pad_id) -> list[list[int]]:
    """Greedy continuation of each prompt (rows may differ in length); each stops after its eos or
    after ``max_new_tokens``. Returns the new tokens per row, the eos included when it came."""
    rows = [[int(t) for t in p] for p in prompt_ids]
    if any(not r for r in rows):
        raise ValueError("every prompt needs at least one token (the bos)")
    lengths = [len(r) for r in rows]
    ids = torch.full((len(rows), max(lengths) + max_new_tokens), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    out: list[list[int]] = [[] for _ in rows]
    active = list(range(len(rows)))
    while active:
        width = max(lengths[i] for i in active)
        logits = model_fn(ids[active, :width])
        if logits.shape[:2] != (len(active), width):
            raise ValueError(f"generate_fn returned logits of shape {tuple(logits.shape)} for input "
                             f"{(len(active), width)}; expected [B, T, V]")
        last = torch.tensor([lengths[i] - 1 for i in active], device=logits.device)
        picked = logits[torch.arange(len(active), device=logits.device), last].argmax(-1).tolist()
        still = []
        for i, token in zip(active, picked):
            out[i].append(token)
            ids[i, lengths[i]] = token
            lengths[i] += 1
            if token != eos_id and len(out[i]) < max_new_tokens:
                still.append(i)
        active = still
    return out


def predict(generate_fn: GenerateFn, examples: Sequence[Example], batch_size: int = 64, *,
            tokenizer: CharTokenizer | None = None, max_new_tokens: int | None = None) -> list[str | None]:
    """The decoded worked answer per example, or None where the model did not end with eos in time (or
    wrote an id the tokenizer cannot decode: a model whose vocabulary is larger than the tokenizer's).
    ``max_new_tokens`` defaults to the longest reference worked answer plus its eos."""
    tok = tokenizer or CharTokenizer()
    budget = max_new_tokens or max(len(ex.solution) for ex in examples) + 1
    answers: list[str | None] = []
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo:lo + batch_size]
        prompts = [tok.encode(ex.prompt, bos=True) for ex in chunk]
        for new in greedy_generate(generate_fn, prompts, budget, eos_id=tok.eos_id, pad_id=tok.pad_id):
            answers.append(_decode(tok, new[:-1]) if new and new[-1] == tok.eos_id else None)
    return answers


def _decode(tok: CharTokenizer, ids: list[int]) -> str | None:
    try:
        return tok.decode(ids)
    except ValueError:          # an id outside the tokenizer's vocabulary: no answer
        return None


def exact_match(generate_fn: GenerateFn, examples: Sequence[Example], batch_size: int = 64, *,
                tokenizer: CharTokenizer | None = None, max_new_tokens: int | None = None) -> float:
    """Share of examples whose greedy worked answer, ended by eos in time, ends with exactly the
    reference answer (the digits after its last ``=``, read in the example's answer format:
    ``Example.final_answer``)."""
    if not examples:
        raise ValueError("exact_match needs at least one example")
    got = predict(generate_fn, examples, batch_size, tokenizer=tokenizer, max_new_tokens=max_new_tokens)
    return sum(ex.final_answer(g) == ex.answer for g, ex in zip(got, examples)) / len(examples)
