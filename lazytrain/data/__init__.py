"""Your data for fine-tuning: dataset files in the common formats, tokenized with the model's own
tokenizer and chat template, labelled, packed, and batched.  JSONL / JSON are read here; parquet, CSV / TSV, Arrow
and ``datasets`` folders through pyarrow (``tables.py``), a record batch at a time; ``prepare_data``
(``app/finetune/prepare.py``) encodes them as they are read into a ``TokenStore`` on disk (``store.py``).

    >>> from lazytrain.data import Batches, Encoder, read_records
    >>> enc = Encoder(tokenizer)                                   # a transformers tokenizer
    >>> examples = [enc.encode(r) for r in read_records("train.jsonl")]
    >>> batches = Batches(examples, batch_size=8, seq_len=512, pad_id=tokenizer.pad_token_id, pack=True)
    >>> trainer.step(batches.batch(0))     # a plan compiled with packed=True takes its position_ids
"""

from .batches import Batches, collate, held_out, pack_rows
from .encode import IGNORE, LOSS_ON, Encoder, Example, fit
from .formats import FORMATS, DataError, Record, iter_records, parse_record, read_records
from .kinds import FILE_FORMATS
from .store import TokenStore, TrainSet

__all__ = ["FILE_FORMATS", "FORMATS", "IGNORE", "LOSS_ON", "Batches", "DataError", "Encoder", "Example", "Record",
           "TokenStore", "TrainSet", "collate", "fit", "held_out", "iter_records", "pack_rows", "parse_record",
           "read_records"]
