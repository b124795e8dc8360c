"""The trained model as a Hugging Face folder that transformers, vLLM or llama.cpp's converter load.

Layout of ``DIR`` (what ``save_pretrained`` writes, always sharded)::

    config.json                                 the model's config, ``dtype`` the exported one, no quantization
    model-00001-of-0000N.safetensors ...        weights by their Hugging Face names, tied weights once
    model.safetensors.index.json                which file holds which weight, and the total size
    generation_config.json                      eos_token_id: every token that ends a reply (eos, end-of-turn)
    tokenizer.json, tokenizer_config.json, ...  the tokenizer, chat template included

*Memory.*  Weights are read one at a time from where they live — the trainer's host store (one
block's fp32 master at a time) or a checkpoint's safetensors files (memory-mapped, one tensor at a
time) — cast to the export dtype and written shard by shard: at most one shard (``max_shard_bytes``)
is held, never a second copy of the model (a 70B export needs ~5 GB, not 140).

*Atomicity.*  Everything is written into ``DIR.tmp-XXXX`` next to the target and fsynced, then
renamed over ``DIR`` the way checkpoints are (``runtime/checkpoint.py``): a crash leaves the old
folder or the new one, never half of one.  A ``DIR`` that exists and is not a model folder (no
``config.json``) is not replaced.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..ir import Plan, PlanError
from ..runtime.checkpoint import META, CheckpointError, read_meta
from ..runtime.manifest import check_files
from ..util.atomic import fsync_file, staged_folder

#: shard size: ``save_pretrained``'s default ("5GB"), so one shard is what an export holds in memory
MAX_SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"


class ExportError(ValueError):
    """What cannot be exported (a target folder that is not a model folder, weights that do not fit the
    config); the message names the folder."""


@dataclass(frozen=True)
class Weight:
    """One tensor to export: its Hugging Face name, shape, and how to read it (fp32 or any dtype)."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def write_folder(target, weights: list[Weight], *, config: dict, dtype: torch.dtype, tokenizer=None,
                 generation_config=None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the folder (see the module docstring) atomically at ``target``; returns its path."""
    target = Path(target).absolute()
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / "config.json").exists())):
        raise ExportError(f"{target} exists and is not a model folder (no config.json): refusing to replace it")
    with staged_folder(target) as tmp:
        _write_weights(tmp, weights, dtype, max_shard_bytes)
        write_hf_json(tmp / "config.json", {**config, "dtype": str(dtype).removeprefix("torch.")})
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        share_folder(tmp)
    return target


def share_folder(tmp: Path) -> None:
    """A staged folder's files fsynced and given the modes of a folder for others to read (the umask's), not
    mkdtemp's private ones."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
        fsync_file(f)
    os.chmod(tmp, 0o777 & ~umask)


def _write_weights(folder: Path, weights: list[Weight], dtype: torch.dtype, max_shard_bytes: int) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list[Weight]] = [[]]
    used = 0
    for w in weights:
        nbytes = math.prod(w.shape) * size
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(w)
        used += nbytes
    n = len(shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for w in shard:
            t = w.read()
            if tuple(t.shape) != tuple(w.shape):
                raise ExportError(f"weight {w.name} has shape {tuple(t.shape)}, expected {w.shape}")
            tensors[w.name] = t.to(dtype).contiguous()
            weight_map[w.name] = name
            total += tensors[w.name].numel() * size
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
    write_hf_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_hf_json(path: Path, obj: dict) -> None:
    """``obj`` as a model folder's JSON files are written (indented, keys sorted, a final newline)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def hf_config(config, model_class: str | None = None) -> dict:
    """A model config as the dict ``config.json`` holds: no quantization (GGUF and friends are
    dequantized), ``architectures`` set."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for k in ("quantization_config", "_name_or_path", "torch_dtype"):
        d.pop(k, None)
    if not d.get("architectures") and model_class:
        d["architectures"] = [model_class]
    return d


# ---- where the weights come from ---------------------------------------------------------------------

def trainer_weights(trainer, checkpoint=None) -> list[Weight]:
    """The trainer's current weights (pending updates applied), block by block from its host store;
    tied weights once, under their first name, and the model's persistent buffers.  A trainer of several
    ranks holds only its shard: its weights are those of ``checkpoint``, which every rank saved just now
    (read by one rank, tensor by tensor, so no rank gathers a second copy of the model)."""
    if trainer.world is not None:
        if checkpoint is None:
            raise ExportError("a trainer of several ranks exports from the checkpoint the ranks saved: pass it")
        out = checkpoint_weights(checkpoint)
        return out + _buffers(trainer.model, {w.name for w in out})
    trainer.flush()
    cache: dict[int, torch.Tensor] = {}

    def block(j: int) -> torch.Tensor:
        if j not in cache:
            cache.clear()                 # one block's master at a time
            cache[j] = trainer.optimizer.master(j)
        return cache[j]

    out = []
    for j, lay in enumerate(trainer.store.layouts):
        for s in lay.segments:
            if s.offset < lay.trainable_numel:
                out.append(Weight(s.name, tuple(s.shape),
                                  lambda j=j, s=s: block(j)[s.offset:s.offset + s.numel].view(s.shape)))
            elif s.offset < lay.owned_numel:      # a frozen parameter: its load buffer is all there is of it
                # (a quantized base: dequantized, the values the adapters trained against)
                out.append(Weight(s.name, tuple(s.shape), lambda j=j, s=s: trainer.frozen_param(j, s)))
    out += _buffers(trainer.model, {w.name for w in out})
    return out


def module_weights(model) -> list[Weight]:
    """The weights of a plain ``nn.Module`` (tied ones once, under their first name) and its persistent
    buffers."""
    out = [Weight(n, tuple(p.shape), lambda p=p: p.detach()) for n, p in model.named_parameters()]
    return out + _buffers(model, {w.name for w in out})


def _buffers(model, have: set[str]) -> list[Weight]:
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return [Weight(n, tuple(t.shape), lambda t=t: t) for n, t in model.state_dict().items()
            if n not in params and n not in have and t.device.type != "meta"]


def checkpoint_weights(directory, *, adapters: bool = False) -> list[Weight]:
    """The weights of a checkpoint folder (``runtime/checkpoint.py``), read one tensor at a time.  A checkpoint
    of a frozen base (LoRA) holds its adapters alone: refused unless ``adapters`` asks for just those."""
    folder, meta = read_meta(directory)
    if "base" in meta and not adapters:
        raise ExportError(f"checkpoint {folder} holds LoRA adapters only, not the base they adapt: export it with "
                          f"lazytrain export (its adapter folder, and the merged model with --merge)")
    check_files(folder, meta)           # every file's size and SHA-256, as a resume checks them
    if "world" in meta:                 # each file holds flat pieces of the tensors (checkpoint_world.py)
        return _sharded_weights(folder, meta)
    out = []
    for fname in sorted(meta["files"]):
        path = folder / fname
        shapes = {k: tuple(v["shape"]) for k, v in meta["files"][fname]["tensors"].items()}
        header = _header(path)
        if header != shapes:
            raise CheckpointError(f"{path}: its tensors are not the ones {folder / META} records: the manifest "
                                  f"was edited")
        out += [Weight(k.removeprefix("param."), shape, lambda p=path, k=k: _read(p, k))
                for k, shape in header.items() if k.startswith("param.")]
    return out


def _sharded_weights(folder: Path, meta: dict) -> list[Weight]:
    """The weights of a checkpoint of several ranks: each tensor's pieces (``[first, end)`` of its flat
    elements, one per rank file that holds some, as the manifest records them) read and joined in
    element order, one tensor at a time; shapes from the checkpoint's plan."""
    try:
        graph = Plan.from_json(meta["plan"]).graph
    except PlanError as e:
        raise ExportError(f"{folder}: {e}") from None
    where: dict[str, list[tuple[int, int, str]]] = {}
    for fname, rng in meta["world"]["pieces"].items():
        for name, (a, b) in rng.items():
            where.setdefault(name, []).append((a, b, fname))
    out = []
    for block in graph.blocks:
        for p in block.params:
            parts = sorted(where.get(p.name, []))
            ends = [0] + [b for _a, b, _f in parts]
            if [a for a, _b, _f in parts] != ends[:-1] or ends[-1] != p.numel:
                raise ExportError(f"{folder}: the saved pieces of {p.name} do not cover elements [0, {p.numel}): "
                                  "use another checkpoint")
            out.append(Weight(p.name, tuple(p.shape), lambda parts=parts, shape=tuple(p.shape), name=p.name: torch.cat(
                [_read(folder / f, f"param.{name}").reshape(-1) for _a, _b, f in parts]).view(shape)))
    return out


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """The name and shape of each tensor of a checkpoint's file (its header, nothing read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def _read(path: Path, key: str) -> torch.Tensor:
    """Tensor ``key`` of a checkpoint's file that ``check_files`` verified (the files are never rewritten in
    place)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def check_weights(weights: Iterable[Weight], model) -> list[Weight]:
    """``weights`` against ``model`` (built from the config, on ``meta`` is enough): every parameter the
    config's model has is there (a tied one under either name) with its shape; nothing else is."""
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}        # tied: first name only
    tied = {}
    first: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        tied[n] = first.setdefault(id(p), n)
    out, seen = [], set()
    for w in weights:
        name = tied.get(w.name, w.name)
        if name not in want:
            raise ExportError(f"weight {w.name} is not a parameter of the config's model ({type(model).__name__})")
        if w.shape != want[name]:
            raise ExportError(f"weight {w.name} has shape {w.shape}, the config's model {want[name]}")
        out.append(Weight(name, w.shape, w.read))
        seen.add(name)
    missing = sorted(set(want) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ExportError(f"the weights lack {', '.join(missing[:3])}{more} of the config's model")
    return out
