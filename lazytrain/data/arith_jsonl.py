"""The built-in arithmetic problems (``tasks/arith.py``) written out as chat JSONL files, so fine-tuning
a pretrained model on them takes the path a user's own data takes::

    python -m lazytrain.data.arith_jsonl --difficulty easy --train 20000 --eval 200 -o data/arith
    # data/arith/train.jsonl, data/arith/eval.jsonl: {"messages": [{"role": "user", "content":
    #   "Mia has 23 pens. She sells 9. How many pens now?"}, {"role": "assistant", "content": "23-9=14"}]}

Train and eval problems never share their arithmetic (the task's split); the eval problems are
distinct.
"""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path

from ..tasks import eval_examples, train_examples


def chat(ex) -> dict:
    return {"messages": [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.solution}]}


def write(folder, *, difficulty: str = "easy", n_train: int = 20000, n_eval: int = 200, seed: int = 0) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, examples in (("train", islice(train_examples(difficulty, seed=seed), n_train)),
                           ("eval", eval_examples(n_eval, difficulty, seed=seed))):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(chat(ex)) + "\n" for ex in examples))
        out.append(path)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lazytrain.data.arith_jsonl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--difficulty", default="easy")
    ap.add_argument("--train", type=int, default=20000, help="train examples (default 20000)")
    ap.add_argument("--eval", type=int, default=200, help="eval examples (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", default="data/arith", help="folder for train.jsonl and eval.jsonl")
    a = ap.parse_args(argv)
    for p in write(a.output, difficulty=a.difficulty, n_train=a.train, n_eval=a.eval, seed=a.seed):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
