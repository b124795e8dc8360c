"""Built-in tasks that need no download: generated arithmetic word problems, a char tokenizer, batching
and exact-match scoring.

    >>> from lazytrain.tasks import train_batches, eval_examples, exact_match
    >>> batch = next(train_batches(32))                 # easy preset, seq_len 96
    >>> exact_match(model_fn, eval_examples(500), 64)   # model_fn: input_ids [B, T] -> logits [B, T, V]
"""

from .arith import (
    PRESETS,
    Difficulty,
    Example,
    Problem,
    Step,
    StepKind,
    eval_examples,
    final_answer,
    get_difficulty,
    train_examples,
    variant,
)
from .data import (
    IGNORE,
    Batch,
    collate,
    encode_example,
    exact_match,
    greedy_generate,
    predict,
    shifted_cross_entropy,
    train_batches,
)
from .eval_size import check_eval_size
from .formats import OPTIONS as FORMATS
from .formats import Format
from .tokenizer import CharTokenizer

__all__ = ["FORMATS", "IGNORE", "PRESETS", "Batch", "CharTokenizer", "Difficulty", "Example", "Format", "Problem",
           "Step", "StepKind", "check_eval_size", "collate", "encode_example", "eval_examples", "exact_match",
           "final_answer", "get_difficulty", "greedy_generate", "predict", "shifted_cross_entropy", "train_batches",
           "train_examples", "variant"]
