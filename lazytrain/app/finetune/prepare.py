"""Before the first step of ``lazytrain train --data``: the model, its tokenizer, and the data as examples.

``--model`` is a named model (``models/named.py``), a GGUF file, a Hugging Face folder with weights
(fine-tuned), a folder or ``config.json`` without weights, or a preset (both random init: the shape
alone, for throughput runs); ``--tokenizer`` gives the tokenizer when the model has none (or another
one).  The run writes the config, tokenizer and generation config it trains with into
``OUTPUT/source/``, so a resume or ``lazytrain export`` needs neither the original folder nor the
registry.

Data: ``--data`` (and ``--eval-data``) read by ``data/formats.py`` (``--columns`` renaming columns), tokenized by
``data/encode.py`` (``--system-prompt``, the tokenizer's chat template or ``--chat-template``) as it is read, into
a token store on disk (``data/store.py``).
Without ``--eval-data``, 5% of the examples (at most ``--eval-size``, at least one) are held out by a
hash of their content (``data/batches.held_out``).  ``--seq`` defaults to the longest training example,
within the model's positions; longer examples are cut or dropped (``--truncate``) and counted.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...data.batches import LowestKeys, content_digest
from ...data.encode import Encoder, Example, fit
from ...data.formats import DataError, iter_records
from ...data.store import TokenStore, TrainSet, fit_index
from ...frontend.presets import PRESETS
from ...frontend.random_init import random_model
from ...hf.model_loading import (
    from_pretrained,
    has_tokenizer,
    has_weights,
    is_gguf,
    load_gguf,
    load_tokenizer,
    read_config,
    weights_dtype,
)
from ...hf.named import NAMED, model_folder

#: share of the examples held out for evaluation when no --eval-data is given
EVAL_SHARE = 0.05


@dataclass
class Source:
    """What ``--model`` names: how to build the model, where its tokenizer is, what it was stored in."""

    spec: str
    kind: str                             # named | gguf | pretrained | config | preset
    path: Path | None = None
    tokenizer: str | None = None          # a folder or GGUF file with the tokenizer
    dtype: torch.dtype | None = None      # the dtype of the weights it came with (the export keeps it)
    config: dict = field(default_factory=dict)


def resolve(spec: str, log=print) -> Source:
    """The source ``--model`` names (a named model is fetched and cached here, on first use)."""
    if spec in NAMED:
        folder = model_folder(spec, log=log)
        return Source(spec, "named", folder, str(folder), weights_dtype(folder), read_config(folder / "config.json"))
    path = Path(spec)
    if is_gguf(path):
        return Source(spec, "gguf", path, str(path))
    if path.is_dir() and (path / "config.json").is_file():
        tok = str(path) if has_tokenizer(path) else None
        kind = "pretrained" if has_weights(path) else "config"
        return Source(spec, kind, path, tok, weights_dtype(path) if kind == "pretrained" else None,
                      read_config(path / "config.json"))
    if path.is_file() and path.suffix == ".json":
        tok = str(path.parent) if has_tokenizer(path.parent) else None
        return Source(spec, "config", path, tok, None, read_config(path))
    if spec in PRESETS:
        return Source(spec, "preset", None, None, None, dict(PRESETS[spec]))
    if spec == "task":
        raise ValueError("--data needs a model with a tokenizer: --model smollm2-135m-instruct (fetched once), a "
                         "Hugging Face folder, or a GGUF file (the task model has only the task's characters)")
    if path.exists():
        raise ValueError(f"--model {spec}: neither a Hugging Face folder (config.json + *.safetensors) nor a "
                         f"GGUF file")
    raise ValueError(f"--model {spec}: no such file or folder, and not a named model ({', '.join(NAMED)}) or a "
                     f"preset")


def build(src: Source, seed: int, random_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model on the CPU: pretrained weights in fp32; configs and presets with random weights in
    ``random_dtype`` (``random_init.random_model``: N(0, 0.02) from a seeded pool, memory copies instead of a
    7B's minutes of per-module init)."""
    torch.manual_seed(seed)
    if src.kind in ("named", "pretrained"):
        return from_pretrained(src.path)
    if src.kind == "gguf":
        return load_gguf(src.path)
    return random_model(str(src.path) if src.kind == "config" else src.spec, dtype=random_dtype)


def tokenizer_for(src: Source, override: str | None, log=print):
    """The tokenizer: ``--tokenizer`` (a folder, GGUF file or named model) or the model's own."""
    spec = override or src.tokenizer
    if spec is None:
        raise ValueError(f"--model {src.spec} has no tokenizer: pass --tokenizer (a Hugging Face folder, a GGUF "
                         f"file or a named model such as smollm2-135m-instruct)")
    if spec in NAMED:
        spec = str(model_folder(spec, log=log))
    return load_tokenizer(spec)


def set_chat_template(tok, path: str) -> None:
    """``--chat-template FILE``: the Jinja template in ``path`` replaces the tokenizer's (saved with the run's
    tokenizer in ``OUTPUT/source/``, so a resume and the export keep it); one that cannot render a chat is an
    error before any training."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    tok.chat_template = text
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        tok.apply_chat_template(probe, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateSyntaxError, and templates raise what they like
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--chat-template {path}: not a Jinja chat template that renders a chat ({first})") from None


@dataclass
class Data:
    train: TrainSet              # on disk (``data/store.py``): a file larger than memory trains
    eval: list[Example]
    seq_len: int
    counts: dict                 # examples read, held out, truncated, dropped
    fingerprint: str             # of the data files: a resumed run must see the same


def prepare_data(enc: Encoder, data: str, eval_data: str | None, *, seq: int | None, max_positions: int | None,
                 truncate: str, eval_size: int, columns: dict[str, str] | None = None,
                 workdir: str | Path | None = None) -> Data:
    """Read, split, tokenize and fit the examples (see the module docstring), as a stream: each record is encoded
    as it is read into a ``TokenStore`` (in a temporary folder under ``workdir``); only the held-out candidates
    are kept as ``Example``s."""
    digest = hashlib.sha256()           # of the bytes as they are read: a FIFO is read once
    store = TokenStore(workdir)
    lowest = LowestKeys(0 if eval_data else eval_size)
    for rec in iter_records(data, digest, columns):
        ex = enc.encode(rec)
        key = content_digest(rec.key())
        lowest.offer(key, store.append(ex.ids, ex.labels, key), ex)
    store.finish()
    if eval_data:
        evals = _eval_file(enc, eval_data, digest, columns, eval_size)
        _check_held_out(store, evals, data, eval_data)
        evals, train_index = [e for _, e in evals], np.arange(len(store))
    else:
        digest.update(b"-")
        if len(store) < 2:
            raise DataError(f"{data}: one example cannot be split into train and eval; give more, or --eval-data")
        chosen = lowest.chosen(min(eval_size, max(1, round(EVAL_SHARE * len(store)))))
        evals = [e for _, e in chosen]
        train_index = np.setdiff1d(np.arange(len(store)), [i for i, _ in chosen])
        if not len(train_index):
            raise DataError(f"{data}: every example is a copy of the held-out ones; give more, or --eval-data")
    longest = int(store.lengths[train_index].max())
    if seq is None:
        seq = min(longest, max_positions or longest)
    elif max_positions and seq > max_positions:
        raise ValueError(f"--seq {seq} is longer than the model's {max_positions} positions")
    kept, too_long, dropped = fit_index(store, train_index, seq, truncate)
    counts = {"train_read": len(train_index), "eval": len(evals), "held_out": not eval_data,
              "too_long": too_long, "truncate": truncate, "dropped": dropped, "train": len(kept)}
    if not len(kept):
        raise DataError(f"{data}: no example fits --seq {seq} (the longest has {longest} tokens; --truncate "
                        f"{truncate})")
    evals = [k for k in (fit(e, seq, "truncate") for e in evals) if k is not None]
    return Data(TrainSet(store, kept, seq), evals, seq, counts, digest.hexdigest()[:16])


def _eval_file(enc: Encoder, eval_data: str, digest, columns, eval_size: int) -> list[tuple[bytes, Example]]:
    """The first ``eval_size`` examples of ``--eval-data`` with their digests (every record is read: checked, and
    in the fingerprint)."""
    out = []
    for rec in iter_records(eval_data, digest, columns):
        if len(out) < eval_size:
            out.append((content_digest(rec.key()), enc.encode(rec)))
    return out


def _check_held_out(store: TokenStore, evals: list[tuple[bytes, Example]], data: str, eval_data: str) -> None:
    """An error where every eval example is also a training one (``--eval-data`` the ``--data`` file, a copy or a
    part of it): the exact match would measure recall of the training set, reported as if held out.  Some shared:
    said, with the count."""
    shared = int(np.isin(np.array([k for k, _ in evals], dtype="S32"), store.keys).sum()) if evals else 0
    if evals and shared == len(evals):
        raise DataError(f"--eval-data {eval_data}: every eval example is also in --data {data}, so the exact match "
                        f"would measure recall of the training set; give held-out examples, or leave --eval-data "
                        f"out to hold out {EVAL_SHARE:.0%} of --data")
    if shared:
        print(f"note: {shared} of the {len(evals)} eval examples of {eval_data} are also in --data {data}")


def max_positions(config) -> int | None:
    """The positions a model config allows (a dict or a config object), or None when it does not say."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    n = get("max_position_embeddings") or get("n_positions") or get("max_seq")
    return int(n) if n else None


def check_vocab(model, data: Data, name: str) -> None:
    """Every token id fits the model's embedding (a tokenizer of another model would not)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    top = max([data.train.max_id()] + [max(e.ids) for e in data.eval if e.ids])
    if rows is not None and top >= rows:
        raise ValueError(f"the tokenizer gives token ids up to {top}, but {name}'s embedding has {rows} rows: "
                         f"use the model's own tokenizer (or a model with vocab_size > {top})")


def pad_id(tok) -> int:
    for i in (tok.pad_token_id, tok.eos_token_id, 0):
        if i is not None:
            return int(i)
    return 0


def max_new_tokens(tok, examples: list[Example]) -> int:
    """Room for the longest reference reply, with slack for a model that words it differently."""
    longest = max((len(tok(e.reference, add_special_tokens=False).input_ids) for e in examples), default=16)
    return int(math.ceil(longest * 1.5)) + 8
