"""Peak resident memory of reading and encoding a large dataset file (issue #43): the streamed path (parquet or
JSONL -> token store on disk) against the path before it (every record, then every example as Python tuples, in
memory).

    python benchmarks/data_rss.py make --mb 1000 -o /tmp/bigdata        # a parquet + JSONL of generated text, and
                                                                        # a BPE tokenizer trained on a sample of it
    python benchmarks/data_rss.py measure --data /tmp/bigdata/d.parquet --tok /tmp/bigdata/tok
    PYTHONPATH=OLD_CHECKOUT python benchmarks/data_rss.py measure --data /tmp/bigdata/d.jsonl --tok /tmp/bigdata/tok

``measure`` runs ``prepare_data`` of whichever ``lazytrain`` is importable (``PYTHONPATH`` picks the checkout) and
prints one JSON line: peak RSS (``ru_maxrss``), seconds, examples, tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path


def make(mb: int, out: Path, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]

    def text(n: int) -> str:
        return " ".join(rng.choices(words, k=n))
    total, rows_written = mb << 20, 0
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    with pq.ParquetWriter(out / "d.parquet", schema) as pw, open(out / "d.jsonl", "w") as jw:
        size = 0
        while size < total:
            rows = [{"prompt": text(rng.randint(20, 120)), "completion": text(rng.randint(20, 120))}
                    for _ in range(10_000)]
            pw.write_table(pa.Table.from_pylist(rows, schema))
            for r in rows:
                line = json.dumps(r) + "\n"
                jw.write(line)
                size += len(line)
            rows_written += len(rows)
    sample = [text(100) for _ in range(20_000)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(out / "tok")
    parquet = (out / "d.parquet").stat().st_size / 2**20
    print(f"{rows_written} rows, {size / 2**20:.0f} MiB of JSONL, parquet {parquet:.0f} MiB in {out}")


def measure(data: str, tok: str) -> dict:
    from transformers import AutoTokenizer

    import lazytrain
    from lazytrain.app.finetune.prepare import prepare_data
    from lazytrain.data import Encoder
    enc = Encoder(AutoTokenizer.from_pretrained(tok))
    t = time.perf_counter()
    d = prepare_data(enc, data, None, seq=4096, max_positions=None, truncate="truncate", eval_size=100)
    seconds = time.perf_counter() - t
    train = d.train
    tokens = int(train.lengths().sum()) if hasattr(train, "lengths") else sum(len(e) for e in train)
    return {"lazytrain": str(Path(lazytrain.__file__).parent.parent), "data": data,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "seconds": round(seconds, 1), "train_examples": d.counts["train"], "tokens": tokens,
            "fingerprint": d.fingerprint}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--mb", type=int, default=1000)
    m.add_argument("-o", type=Path, required=True)
    r = sub.add_parser("measure")
    r.add_argument("--data", required=True)
    r.add_argument("--tok", required=True)
    a = p.parse_args()
    if a.cmd == "make":
        make(a.mb, a.o)
    else:
        print(json.dumps(measure(a.data, a.tok)))


if __name__ == "__main__":
    main()
