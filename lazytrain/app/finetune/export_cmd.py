"""``lazytrain export CHECKPOINT_DIR -o DIR``: any checkpoint as a Hugging Face folder (``export.py``); of a run
folder, its newest complete checkpoint (``saves.py``).

The checkpoint holds the weights; the config comes from ``--config``, else from the run the checkpoint
belongs to (``OUTPUT/source/config.json`` of a ``--data`` run, or the config its ``metrics.json``
recorded), and the tokenizer and generation config from ``--tokenizer`` or that run's ``source/``.
The weights are checked against the model the config builds (on ``meta``: no memory) before anything
is written.  A LoRA run's checkpoint (adapters and the base's identity) gives ``DIR/adapter/`` and, with
``--merge``, ``DIR/model/`` (``lora_export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...frontend.hf_export import is_hf
from ...frontend.presets import build_from_config
from ...hf.export import ExportError, check_weights, checkpoint_weights, hf_config, write_folder
from ...hf.model_loading import has_tokenizer, read_config
from ...runtime.checkpoint import read_extra, read_meta
from .. import saves
from . import lora_export
from .prepare import Source, tokenizer_for


def export_checkpoint(source, output, *, config=None, tokenizer=None, dtype: str | None = None,
                      merge: bool = False) -> list[Path]:
    """The folders written: the model folder; of a LoRA checkpoint, the adapter folder (and the merged one)."""
    ckpt, run = _locate(Path(source))
    cfg = _config(config, run, source, ckpt)
    meta = read_meta(ckpt)[1]
    if "base" in meta:
        return _export_lora(ckpt, run, meta, output, cfg, tokenizer=tokenizer, dtype=dtype, merge=merge)
    if merge:
        raise ExportError(f"{source}: --merge merges LoRA adapters, and this checkpoint holds a whole model "
                          f"(export it without --merge)")
    model = build_from_config(cfg, device="meta", dtype=torch.float32, source=str(config or run or source))
    if not is_hf(model):
        raise ExportError(f"{source}: the model ({cfg.get('model_type')}) is not a Hugging Face architecture; "
                          f"only those export to a Hugging Face folder")
    weights = check_weights(checkpoint_weights(ckpt), model)
    tok, gen = _tokenizer(tokenizer, run)
    return [write_folder(output, weights, config=hf_config(cfg, type(model).__name__), dtype=_dtype(dtype, cfg),
                         tokenizer=tok, generation_config=gen)]


def _export_lora(ckpt: Path, run: Path | None, meta: dict, output, cfg: dict, *, tokenizer, dtype, merge: bool):
    """A LoRA checkpoint's adapter folder (and merged folder): its settings (the LoRA spec) from its metrics."""
    try:
        settings = json.loads(_run_metrics(ckpt, run))["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{ckpt}: a LoRA checkpoint without its run's metrics.json, which holds the LoRA "
                          f"settings ({e})") from None
    tok, gen = _tokenizer(tokenizer, run)
    return lora_export.export_checkpoint(ckpt, meta, output, settings=settings, config=cfg, tokenizer=tok,
                                         generation_config=gen, dtype=_dtype(dtype, cfg), merge=merge)


def _dtype(name: str | None, cfg: dict) -> torch.dtype:
    """--dtype, else the config's, else float32."""
    name = name or str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.float32


def _locate(src: Path) -> tuple[Path, Path | None]:
    """(checkpoint folder, run folder or None): a checkpoint folder named (``OUTPUT/checkpoint-STEP`` too), or a run
    folder's newest complete checkpoint, the final one or a periodic one (``saves.newest``)."""
    if (src / "checkpoint.json").is_file() or (src.with_name(src.name + ".old") / "checkpoint.json").is_file():
        return src, src.parent if (src.parent / "metrics.json").is_file() else None
    newest = saves.newest(src, "lazytrain export") if src.is_dir() else None
    if newest is not None:
        return newest, src
    if not src.exists():
        raise ExportError(f"{src} does not exist: name a run folder (OUTPUT of lazytrain train) or its checkpoint/")
    raise ExportError(f"{src}: neither a checkpoint folder (checkpoint.json) nor a run folder (checkpoint/)")


def _run_metrics(ckpt: Path, run: Path | None) -> bytes:
    """The run's metrics: the copy committed with the checkpoint (its SHA-256 checked) where it has one, else
    the run folder's, if a regular file (a FIFO would block the read)."""
    folder, meta = read_meta(ckpt)
    if "metrics.json" in meta["extras"]:
        return read_extra(folder, meta, "metrics.json")
    if run is None or not (run / "metrics.json").is_file():
        raise FileNotFoundError(run / "metrics.json")
    return (run / "metrics.json").read_bytes()


def _config(config, run: Path | None, source, ckpt: Path) -> dict:
    if config:
        p = Path(config)
        return read_config(p / "config.json" if p.is_dir() else p)
    if run is not None and (run / "source" / "config.json").is_file():
        return read_config(run / "source" / "config.json")
    if run is not None:
        try:
            data = _run_metrics(ckpt, run)
        except FileNotFoundError:
            data = b""
        try:
            cfg = json.loads(data)["model"]["config"]
        except (ValueError, KeyError, TypeError, RecursionError):
            cfg = None
        if isinstance(cfg, dict):
            return cfg
    raise ExportError(f"{source}: no config found for the checkpoint (neither its run's source/config.json nor "
                      f"metrics.json): pass --config path/to/config.json")


def _tokenizer(spec, run: Path | None):
    """(tokenizer or None, generation config or None) to include."""
    src_dir = run / "source" if run is not None else None
    gen = None
    if src_dir is not None and (src_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(src_dir)
    if spec is None and src_dir is not None and has_tokenizer(src_dir):
        spec = str(src_dir)
    if spec is None:
        return None, gen
    return tokenizer_for(Source(str(spec), "config", tokenizer=str(spec)), None), gen
