"""Sizes checked before any compile work: batch, sequence, positions, micro-batches x blocks, NVMe folder.

``compile_model`` calls ``check_compile_args`` first, so an absurd size is one clear error at once,
never a trace, a solve or a loop that runs for minutes (the bounds and their reasons are in
``ir/limits.py``).  What the model declares is read without building it where that is cheap (a
preset, a config.json, a module's ``config``); a ``package.module:factory`` is not imported here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..ir.graph import ModelGraph
from ..ir.limits import MAX_BATCH, MAX_MICRO_BATCH_BLOCKS, MAX_SEQ_LEN, MAX_TOKENS, SEARCH_MICRO_BATCH
from ..ir.schema import check_nvme_dir
from ..util.torch_free import is_module, is_module_class
from .preset_configs import PRESETS

#: config fields that declare how many positions a model handles (GPT-2 writes n_positions)
POSITION_FIELDS = ("max_seq", "max_position_embeddings", "n_positions")
#: config fields of a rotary scaling (transformers 5 spells it rope_parameters)
ROPE_FIELDS = ("rope_scaling", "rope_parameters")


def _whole(v, name: str, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if v > hi:
        raise ValueError(f"{name} {v:,} is larger than LazyTrain plans for (at most {hi:,})")
    return v


def check_sizes(batch_size: int, seq_len: int) -> None:
    """Batch, sequence and their product within ``ir/limits.py``'s bounds."""
    _whole(batch_size, "batch_size", MAX_BATCH)
    _whole(seq_len, "seq_len", MAX_SEQ_LEN)
    if batch_size * seq_len > MAX_TOKENS:
        raise ValueError(f"batch_size {batch_size:,} x seq_len {seq_len:,} is {batch_size * seq_len:,} tokens a step, "
                         f"larger than LazyTrain plans for (at most {MAX_TOKENS:,})")


def _custom_loss(model) -> bool:
    """Is ``model`` trained with a loss of the caller's (an ``nn.Sequential`` with its ``loss_fn``, or a graph traced
    from one), not the next-token loss of a language model?"""
    if isinstance(model, ModelGraph):
        return "loss_head" not in model.meta and not model.meta.get("config")
    return is_module(model, "Sequential")


def _config_of(model) -> dict | None:
    """What the model declares, as a dict, when that is cheap to know without building it."""
    if isinstance(model, str):
        if model in PRESETS:
            return PRESETS[model]
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):         # not a file (a factory), or unreadable: build_model says why
            return None
        return cfg if isinstance(cfg, dict) else None
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return cfg if isinstance(cfg, dict) else {k: getattr(cfg, k, None) for k in
                                               (*POSITION_FIELDS, *ROPE_FIELDS, "n_layer", "num_hidden_layers")}


def _scaled_rope(cfg: dict | None) -> bool:
    """Whether the config scales its rotary embedding (dynamic NTK, YaRN, longrope, linear, llama3):
    such a model is configured to run past the length it was pretrained at."""
    def scaled(v) -> bool:
        if not isinstance(v, dict):
            return False
        if (v.get("rope_type") or v.get("type")) not in (None, "default"):
            return True
        return any(scaled(x) for x in v.values() if isinstance(x, dict))    # per attention kind (Gemma-3)
    return any(scaled((cfg or {}).get(key)) for key in ROPE_FIELDS)


def declared_positions(model) -> int | None:
    """The positions ``model`` declares (``max_seq``, ``max_position_embeddings``), or None."""
    cfg = _config_of(model)
    for key in POSITION_FIELDS:
        v = (cfg or {}).get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def scaled_rope(model) -> bool:
    """Whether ``model``'s config scales its rotary embedding (``_scaled_rope``)."""
    return _scaled_rope(_config_of(model))


def check_positions(model, seq_len: int, name: str = "the model") -> None:
    """A sequence longer than the positions the model declares fails at its first step (a learned
    position table is indexed past its end) or extrapolates rotary angles it was never trained on --
    unless its config scales its rotary embedding for longer sequences, which is what that is for."""
    have = declared_positions(model)
    if have is not None and seq_len > have and not scaled_rope(model):
        raise ValueError(f"seq_len {seq_len:,} is beyond the positions {name} handles ({have:,}): use a shorter "
                         f"sequence, or a model configured for more positions")


def min_blocks(model) -> int:
    """A lower bound on the blocks ``model`` traces into: its layers + 1 (embedding; the head may join
    the last block), or 1 when that is not known without tracing."""
    if isinstance(model, ModelGraph):
        return model.n_blocks
    cfg = _config_of(model)
    for key in ("n_layer", "num_hidden_layers"):
        v = (cfg or {}).get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v + 1
    if is_module(model):
        from .trace_export import find_layers  # imports torch.fx: only for a module, which imported torch
        found = find_layers(model)
        if found is not None:
            return len(found[1]) + 1
    return 1


def micro_batch_candidates(batch_size: int, n_blocks: int, micro_batch: int | None = None) -> list[int]:
    """Micro-batch sizes to search, largest first: the given one, else the divisors of the batch up to
    ``SEARCH_MICRO_BATCH`` whose op list stays within ``MAX_MICRO_BATCH_BLOCKS`` (at least the
    largest divisor).  Found in at most 32 trials, whatever the batch."""
    if micro_batch:
        return [micro_batch]
    divisors = [d for d in range(min(batch_size, SEARCH_MICRO_BATCH), 0, -1) if batch_size % d == 0]
    fit = [d for d in divisors if batch_size // d * n_blocks <= MAX_MICRO_BATCH_BLOCKS]
    return fit or divisors[:1]


def check_micro_batches(batch_size: int, n_blocks: int, micro_batch: int | None) -> None:
    """The plan's op list grows with micro-batches x blocks: refuse one that would be too long."""
    mb = micro_batch_candidates(batch_size, n_blocks, micro_batch)[0]
    if batch_size // mb * n_blocks <= MAX_MICRO_BATCH_BLOCKS:
        return
    most = SEARCH_MICRO_BATCH * (MAX_MICRO_BATCH_BLOCKS // n_blocks)
    raise ValueError(f"batch_size {batch_size:,} in micro-batches of {mb} is {batch_size // mb:,} micro-batches x "
                     f"{n_blocks} blocks, more than a plan may hold ({MAX_MICRO_BATCH_BLOCKS:,}; the op list and "
                     f"the compile time grow with it): use a batch with a divisor up to {SEARCH_MICRO_BATCH} "
                     f"(at most {most:,} for this model), or a larger --micro-batch")


def check_model(model) -> None:
    """``model`` is something ``compile_model`` takes: a module instance, a traced ``ModelGraph``, or a string (a
    preset, a config path, ``package.module:factory``); ``ValueError`` naming what was given otherwise."""
    if is_module(model) or isinstance(model, (ModelGraph, str, os.PathLike)):
        return
    if is_module_class(model):
        raise ValueError(f"model is the class {model.__name__}, not a model: pass an instance (e.g. "
                         f"{model.__name__}(config)), a preset name or the path of a config.json")
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        raise ValueError(f"model is a {type(model).__name__}, a configuration: build the model from it (e.g. "
                         f"transformers.AutoModelForCausalLM.from_config(config)), or pass the path of its config.json")
    raise ValueError(f"model must be a torch.nn.Module, a traced ModelGraph, a preset name, a config.json path or "
                     f"'package.module:factory', got {type(model).__name__} {model!r:.60}")


def check_compile_args(model, *, batch_size, seq_len: int, micro_batch: int | None, nvme_dir) -> None:
    """Everything ``compile_model`` can check before tracing (see the module docstring)."""
    check_model(model)
    if seq_len == 1 and not _custom_loss(model):
        raise ValueError("seq_len must be at least 2 for a language model: its loss predicts each token from the "
                         "ones before it, and one token has none to predict")
    if batch_size == "max":
        _whole(seq_len, "seq_len", MAX_SEQ_LEN)
    else:
        check_sizes(batch_size, seq_len)
        if micro_batch is not None and isinstance(micro_batch, int) and micro_batch > 0 and batch_size % micro_batch:
            raise ValueError(f"micro_batch {micro_batch} does not divide batch_size {batch_size}")
        blocks = min_blocks(model)
        if blocks <= MAX_MICRO_BATCH_BLOCKS:      # more is an absurd config, which building it reports
            check_micro_batches(batch_size, blocks, micro_batch)
    check_positions(model, seq_len, f"model {model!r}" if isinstance(model, str) else "the model")
    if nvme_dir is not None:
        check_nvme_dir(nvme_dir)
