"""A dataset no model has seen, for the new-user run of issue #43: what the people of an invented country are
called.  The rule is English's own and regular, so a held-out country's answer follows from its name: a name
ending in -ia takes -n (Veltoria: Veltorian), in -a -n too (Oskara: Oskaran), in -y -an (Drelmy: Drelmian, the y
dropped), in a consonant -ese (Tarvok: Tarvokese), in another vowel -an (Quelo: Quelan, the vowel dropped).
A chat model answers in sentences before it is fine-tuned, so exact match (the whole stripped reply against the
demonym: the answers have no numbers) starts near 0.

Written as a parquet file with the columns a user's export would have (``question``, ``answer``, ``id``), so the
run reads it through the column mapping: ``--columns question=instruction,answer=output`` (an alpaca record: one
user turn and the reply, rendered with the model's chat template).

    python benchmarks/demonyms_data.py --out data/demonyms      # train.parquet (300) + eval.parquet (40)
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "pr", "qu", "r", "s", "st", "t",
          "tr", "v", "vr", "z", "th", "sh"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
CODAS = ["", "", "l", "n", "r", "s", "m", "k", "th"]
ENDINGS = ["ia", "a", "y", "", "o"]          # the last: a consonant ending (no ending added)
QUESTIONS = ["What are the people of {c} called?", "What do you call someone from {c}?",
             "Name the demonym of {c}.", "A person born in {c} is called what?",
             "What is the word for a citizen of {c}?"]


def country(rng: random.Random) -> str:
    syllables = 2
    stem = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
    end = rng.choice(ENDINGS)
    if end and stem[-1] in "aeiouy":
        stem += rng.choice(["l", "r", "n", "v"])
    if not end and stem[-1] in "aeiouy":
        stem += rng.choice(["k", "r", "n", "st"])
    return (stem + end).capitalize()


def demonym(name: str) -> str:
    if name.endswith("a"):           # -ia and -a
        return name + "n"
    if name.endswith("y"):
        return name[:-1] + "ian"
    if name[-1] in "eiou":
        return name[:-1] + "an"
    return name + "ese"


def rows(n: int, rng: random.Random, taken: set[str]) -> list[dict]:
    out = []
    while len(out) < n:
        c = country(rng)
        if c in taken:
            continue
        taken.add(c)
        out.append({"id": len(taken), "question": rng.choice(QUESTIONS).format(c=c), "answer": demonym(c)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/demonyms")
    ap.add_argument("--train", type=int, default=300)
    ap.add_argument("--eval", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng, taken = random.Random(a.seed), set()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", a.train), ("eval", a.eval)):
        pq.write_table(pa.Table.from_pylist(rows(n, rng, taken)), out / f"{name}.parquet")
        print(f"wrote {out / f'{name}.parquet'} ({n} rows)")


if __name__ == "__main__":
    main()
