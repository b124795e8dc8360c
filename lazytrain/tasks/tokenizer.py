"""A character tokenizer with a fixed vocabulary: three special ids, then printable ASCII, one id each.

No files: the vocabulary is this module. ``CharTokenizer().vocab_size == 98``::

    0 <pad>   1 <bos>   2 <eos>   3 ' '   4 '!' ... 97 '~'
"""

from __future__ import annotations

from collections.abc import Iterable

ALPHABET = "".join(chr(c) for c in range(32, 127))  # printable ASCII, space first
SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has a repeated character")
        self.alphabet = alphabet
        self._id = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._id[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out = []
        for i in map(int, ids):
            if i < len(SPECIALS):
                if not skip_special:
                    out.append(SPECIALS[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(SPECIALS)])
            else:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, pad={self.pad_id}, bos={self.bos_id}, eos={self.eos_id})"
