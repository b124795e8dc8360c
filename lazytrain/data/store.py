"""Encoded examples kept compactly on disk, so a dataset larger than memory trains: ``TokenStore`` appends each
example's token ids (int32) and label mask (uint8) to flat files as it is encoded, and reads them back through
memory maps; ``TrainSet`` is the training examples (the store less the held-out ones, fitted to ``seq``) as the
sequence ``Batches`` indexes.

A label is the token at its position or ignored (``encode.py``), so a mask of one byte a token holds the labels:
5 bytes a token where Python tuples of ids and labels took some 16 (and a record's text, kept until then, more).
Held in memory: the offsets (8 bytes an example) and the lengths.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..frontend.loss_head import IGNORE

#: tokens buffered before a write
_FLUSH = 1 << 20


@dataclass(frozen=True, slots=True)
class Tokens:
    """One stored example as ``collate`` takes it: ids and labels (numpy arrays)."""

    ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


class TokenStore:
    """Examples appended in order (``append``), then read (``finish``, ``tokens(i)``).  The files are made in a
    temporary folder under ``folder`` (default: the system's) and their names removed at once: the open files
    hold the data, and the disk space goes back when the process ends, however it ends (a killed run leaves
    nothing in its folder)."""

    def __init__(self, folder: str | Path | None = None):
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="lazytrain-tokens-", dir=folder))
        try:
            self._ids_f, self._mask_f, self._keys_f = (open(tmp / name, "w+b") for name in
                                                       ("ids.bin", "mask.bin", "keys.bin"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)       # (where open files cannot lose their names: at exit)
            if tmp.exists():
                weakref.finalize(self, shutil.rmtree, str(tmp), True)
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._buffered = 0
        self.offsets = array("q", [0])
        self.max_id = -1
        self.ids = self.mask = self.keys = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def append(self, ids, labels, key: bytes) -> int:
        """Store one example (``key``: its 32-byte content digest); returns its index."""
        ids_a = np.asarray(ids, dtype=np.int64)
        lab = np.asarray(labels, dtype=np.int64)
        keep = lab != IGNORE
        if ids_a.shape != lab.shape or not np.array_equal(lab[keep], ids_a[keep]):
            raise ValueError("a stored example's labels must be its ids or ignored")
        if len(ids_a):
            self.max_id = max(self.max_id, int(ids_a.max()))
        self._ids.append(ids_a.astype(np.int32))
        self._mask.append(keep.astype(np.uint8))
        self._keys_f.write(key)
        self.offsets.append(self.offsets[-1] + len(ids_a))
        self._buffered += len(ids_a)
        if self._buffered >= _FLUSH:
            self._flush()
        return len(self) - 1

    def _flush(self) -> None:
        if self._ids:
            self._ids_f.write(np.concatenate(self._ids).tobytes())
            self._mask_f.write(np.concatenate(self._mask).tobytes())
        self._ids, self._mask, self._buffered = [], [], 0

    def finish(self) -> TokenStore:
        """Write what is buffered and map the files for reading."""
        self._flush()
        n = self.offsets[-1]
        self.ids = self._map(self._ids_f, np.int32, n)
        self.mask = self._map(self._mask_f, np.uint8, n)
        self.keys = self._map(self._keys_f, "S32", len(self))
        self.starts = np.frombuffer(self.offsets, dtype=np.int64)
        self.lengths = np.diff(self.starts)
        return self

    @staticmethod
    def _map(f, dtype, n: int) -> np.ndarray:
        f.flush()
        return np.memmap(f, dtype, "r", shape=(n,)) if n else np.zeros(0, dtype)

    def tokens(self, i: int, limit: int | None = None) -> Tokens:
        a = int(self.starts[i])
        b = int(self.starts[i + 1]) if limit is None else min(int(self.starts[i + 1]), a + limit)
        ids = np.asarray(self.ids[a:b], dtype=np.int64)
        labels = np.where(self.mask[a:b] != 0, ids, IGNORE)
        return Tokens(ids, labels)

    def has_label_within(self, i: int, limit: int) -> bool:
        """Whether example ``i`` cut to ``limit`` tokens keeps a label past its first token (``encode.fit``)."""
        a = int(self.starts[i])
        return bool(self.mask[a + 1:a + limit].any())


class TrainSet:
    """The training examples: ``store``'s examples at ``index``, each cut to ``seq_len`` tokens (those that do
    not fit were left out of ``index`` or are cut, as ``encode.fit`` says)."""

    def __init__(self, store: TokenStore, index: np.ndarray, seq_len: int):
        self.store, self.index, self.seq_len = store, np.asarray(index, dtype=np.int64), seq_len

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Tokens:
        return self.store.tokens(int(self.index[i]), self.seq_len)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        return np.minimum(self.store.lengths[self.index], self.seq_len)

    def max_id(self) -> int:
        return self.store.max_id


def fit_index(store: TokenStore, index: np.ndarray, seq_len: int, mode: str) -> tuple[np.ndarray, int, int]:
    """(the examples at ``index`` that fit ``seq_len`` as ``encode.fit`` says, how many were longer, how many of
    those left out): ``drop`` leaves out every longer one, ``truncate`` those with no label left once cut."""
    if mode not in ("truncate", "drop"):
        raise ValueError(f"truncate mode must be truncate or drop, got {mode!r}")
    index = np.asarray(index, dtype=np.int64)
    long = store.lengths[index] > seq_len
    keep = ~long
    if mode == "truncate":
        keep[long] = [store.has_label_within(int(i), seq_len) for i in index[long]]
    return index[keep], int(long.sum()), int((long & ~keep).sum())
