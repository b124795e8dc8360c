"""Examples -> training batches, one example a row (right-padded) or several (``pack``).

*Packing.*  A row holds whole examples back to back; ``position_ids`` count from 0 in each, and a
plan compiled with ``packed=True`` lets a token attend only to its own example
(``frontend/packing.py``).  The first token of each example gets no label: unpacked, nothing predicts
it (the loss compares ``logits[t]`` with ``labels[t + 1]``), packed, the previous example's last token
would.  So a packed batch has the same labelled tokens, each predicted from the same context at the
same positions, as the same examples unpacked: the same loss and gradients (tested in fp32).
Rows are filled best-fit (each example, in the epoch's shuffled order, goes to the row it fills the
most), so they come out nearly full; the rows are then shuffled.

*Order.*  Epoch ``e`` shuffles the examples with ``Random(f"{seed}/{e}")``; ``batch(step)`` is a pure
function of the step, so a resumed run sees the batches an uninterrupted one would.  The last batch
of an epoch may have fewer rows (the Trainer pads it, exactly).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from .encode import IGNORE, Example


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``seq_len`` tokens, best-fit in the given order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []        # (room left, row), sorted
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"example {i} has {n} tokens, more than seq_len={seq_len}")
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def collate(examples: Sequence[Example], seq_len: int, pad_id: int, *, packed_rows=None) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` ([rows, seq_len], right-padded with ``pad_id`` / ignored labels) and, for
    ``packed_rows`` (lists of indices into ``examples``), ``position_ids`` restarting at every example."""
    rows = packed_rows if packed_rows is not None else [[i] for i in range(len(examples))]
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    pos = torch.arange(seq_len, dtype=torch.long).repeat(len(rows), 1)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            ex = examples[i]
            n = len(ex)
            ids[r, at:at + n] = torch.as_tensor(ex.ids)
            labels[r, at:at + n] = torch.as_tensor(ex.labels)
            labels[r, at] = IGNORE
            pos[r, at:at + n] = torch.arange(n)
            at += n
        if at < seq_len:        # the padding continues the last example's count (later than every real token)
            pos[r, at:] = torch.arange(at, seq_len) - (at - n if members else 0)
    out = {"input_ids": ids, "labels": labels}
    if packed_rows is not None:
        out["position_ids"] = pos
    return out


class Batches:
    """The training stream: ``batch(step)`` for step 0, 1, 2, ... (epochs follow one another).  ``examples``: a
    list of ``Example``, or a ``store.TrainSet`` (read from disk a batch at a time)."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seq_len: int, pad_id: int, *,
                 pack: bool = False, seed: int = 0):
        if not len(examples):
            raise ValueError("no training examples")
        if not hasattr(examples, "lengths"):
            examples = list(examples)
        self.examples, self.batch_size, self.seq_len, self.pad_id = list(examples), batch_size, seq_len, pad_id
        self.pack, self.seed = pack, seed
        self._epoch: tuple[int, list[list[int]]] | None = None
        lengths = examples.lengths() if hasattr(examples, "lengths") else [len(e) for e in examples]
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.rows_per_epoch = len(self._rows(0))

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.rows_per_epoch / self.batch_size)

    def _rows(self, epoch: int) -> list[list[int]]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = random.Random(f"{self.seed}/{epoch}")
            order = list(range(len(self.examples)))
            rng.shuffle(order)
            if self.pack:
                rows = [[order[i] for i in row] for row in
                        pack_rows(self.lengths[order].tolist(), self.seq_len)]
                rng.shuffle(rows)
            else:
                rows = [[i] for i in order]
            self._epoch = (epoch, rows)
        return self._epoch[1]

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        epoch, k = divmod(step, self.steps_per_epoch)
        rows = self._rows(epoch)[k * self.batch_size:(k + 1) * self.batch_size]
        if self.pack:
            return collate(self.examples, self.seq_len, self.pad_id, packed_rows=rows)
        return collate([self.examples[r[0]] for r in rows], self.seq_len, self.pad_id)

    def padding(self) -> dict[str, float]:
        """The fraction of padding tokens in an epoch, packed and one example a row, at this ``seq_len``; a
        packed stream's unpacked figure is at the longest example's length (what an unpacked run would use)."""
        lengths = self.lengths
        tokens = int(lengths.sum())
        packed_rows = self.rows_per_epoch if self.pack else len(pack_rows(lengths.tolist(), self.seq_len))
        unpacked_seq = int(lengths.max()) if self.pack else self.seq_len
        return {"unpacked": round(1 - tokens / (len(lengths) * unpacked_seq), 4),
                "packed": round(1 - tokens / (packed_rows * self.seq_len), 4)}


def content_digest(key: str) -> bytes:
    """The 32-byte hash of an example's content (``Record.key``) the held-out split orders examples by."""
    return hashlib.sha256(f"lazytrain.data/{key}".encode()).digest()


def held_out(items: Sequence, keys: Sequence[str], n_eval: int) -> tuple[list, list]:
    """(train, eval): the ``n_eval`` items (at least) whose content hashes lowest, and the rest.  Fixed by
    the content, not the file order or a seed; identical examples land on the same side."""
    if n_eval <= 0:
        return list(items), []
    digest = [content_digest(k) for k in keys]
    counts = Counter(digest)
    chosen: set[str] = set()
    count = 0
    for d in sorted(counts):
        if count >= n_eval:
            break
        chosen.add(d)
        count += counts[d]
    train = [x for x, d in zip(items, digest) if d not in chosen]
    evals = [x for x, d in zip(items, digest) if d in chosen]
    return train, evals


class LowestKeys:
    """``held_out`` over a stream: offered each example's digest as it is read, it keeps the ``limit`` lowest
    distinct digests seen so far with every example of each (index, item).  Held-out examples are at most
    ``limit``, so they are among these whatever the stream's length (``chosen`` picks them once it is known), and
    the split is ``held_out``'s: by content, whatever the order."""

    def __init__(self, limit: int):
        self.limit = limit
        self.order: list[bytes] = []                 # sorted
        self.items: dict[bytes, list[tuple[int, object]]] = {}

    def offer(self, key: bytes, index: int, item) -> None:
        if self.limit <= 0:
            return
        if key in self.items:
            self.items[key].append((index, item))
        elif len(self.order) < self.limit or key < self.order[-1]:
            bisect.insort(self.order, key)
            self.items[key] = [(index, item)]
            if len(self.order) > self.limit:
                del self.items[self.order.pop()]

    def chosen(self, n_eval: int) -> list[tuple[int, object]]:
        """The held-out (index, item)s, in stream order: the lowest digests until ``n_eval`` examples at least."""
        out: list[tuple[int, object]] = []
        for key in self.order:
            if len(out) >= n_eval:
                break
            out += self.items[key]
        return sorted(out, key=lambda x: x[0])
