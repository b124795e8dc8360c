"""Where a trainer's initial parameters come from: the model's own tensors, or a Hugging Face safetensors
folder read piece by piece.

A trainer copies into its host store only what it holds: with N ranks, its shard of every block
(``shards.init_shards``: elements ``[a, b)`` of some tensors).  Building the whole model on every rank
first holds N copies of it in host memory at start-up.  A model built on the meta device with a
``SafetensorsWeights`` instead reads, for each piece, only the rows of the tensor that cover it
(``safe_open(...).get_slice``): a rank's host memory at start is its shard plus one tensor's rows.
Both sources answer ``piece(name, a, b)``: elements ``[a, b)`` of the flat tensor, fp32 on the CPU; so do
``frontend.random_init.RandomWeights`` (a config's or a preset's random weights, computed a piece at a time) and
``CheckpointFilled`` (a resumed trainer's: its checkpoint writes every element, so nothing of the model is read).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class ModelWeights:
    """The model's own parameters (and, for a name ``named_parameters`` does not list, its state dict)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.named = dict(model.named_parameters(remove_duplicate=False))
        self._sd = None

    def piece(self, name: str, a: int, b: int) -> torch.Tensor:
        src = self.named.get(name)
        if src is None:
            self._sd = self._sd if self._sd is not None else self.model.state_dict()
            src = self._sd[name]
        return src.detach().reshape(-1)[a:b].to(torch.float32)


class SafetensorsWeights:
    """The tensors of a Hugging Face folder's ``*.safetensors`` files, read a piece at a time.

    Built against the model (on the meta device is enough): every parameter it trains must be in the
    folder with the model's shape, checked from the files' headers before anything is read, so a missing
    or misshapen weight is one error naming it, not a layer silently left uninitialised."""

    def __init__(self, folder: str | Path, model: torch.nn.Module):
        self.folder = Path(folder)
        headers = safetensors_headers(self.folder)
        if not headers:
            raise ValueError(f"{self.folder}: no *.safetensors weights to read the model's shards from")
        self.where = {k: f for k, (f, _dtype, _shape) in headers.items()}
        shapes = {k: shape for k, (_f, _dtype, shape) in headers.items()}
        bad = []
        for name, p in model.named_parameters():       # each tensor once (tied ones by their first name)
            if name not in shapes:
                bad.append(f"{name} (missing from the weights)")
            elif shapes[name] != tuple(p.shape):
                bad.append(f"{name} (weights {shapes[name]}, config {tuple(p.shape)})")
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise ValueError(f"{self.folder}: the weights do not match config.json: {', '.join(bad[:3])}{more}")

    def piece(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of tensor ``name`` (flat), reading only the rows that hold them."""
        from safetensors import safe_open
        with safe_open(str(self.where[name]), framework="pt") as st:
            sl = st.get_slice(name)
            shape = sl.get_shape()
            if len(shape) <= 1:
                t = sl[a:b].reshape(-1)
            else:
                row = math.prod(shape[1:])
                first = a // row
                t = sl[first:-(-b // row)].reshape(-1)[a - first * row:b - first * row]
        return t.to(torch.float32)


#: the index files of a sharded Hugging Face folder: which file holds each weight
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def safetensors_headers(folder: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Each tensor of a Hugging Face folder's ``*.safetensors`` files: ``name -> (file, dtype, shape)`` (the
    dtype as safetensors names it, ``"BF16"``), from the headers, nothing else read.  Every file the folder's
    index names must be there (``check_index``), and a file that is not a safetensors file (truncated, empty,
    a header past the end, offsets beyond the file: what safetensors checks when it opens one) is a ValueError
    naming it.  Where the index names a tensor's file, that one holds it."""
    from safetensors import SafetensorError, safe_open
    mapped = check_index(folder)
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    if k not in out or mapped.get(k) == f.name:
                        out[k] = (f, sl.get_dtype(), tuple(sl.get_shape()))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e}): the model folder is damaged") from None
    return out


def check_index(folder: Path) -> dict[str, str]:
    """The weight map (tensor name -> file name) of ``folder``'s index file, if it has one, after checking it:
    a folder whose index names weight files that are not there is damaged or half downloaded, not a model to
    initialise at random.  A folder without an index maps nothing."""
    for name in INDEXES:
        index = folder / name
        if not index.is_file():
            continue
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"{index}: not a weight index ({type(e).__name__}: {e})") from None
        if not wmap:
            raise ValueError(f"{index} maps no weights: the model folder is damaged")
        outside = sorted({f for f in wmap.values() if Path(f).name != f or f in (".", "..")})
        if outside:
            raise ValueError(f"{index} names files outside its folder ({', '.join(outside[:3])}): the model folder "
                             f"is damaged")
        missing = sorted({f for f in wmap.values() if not (folder / f).is_file()})
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ValueError(f"{index} names weight files that are missing: {', '.join(missing[:3])}{more} (of "
                             f"{len(set(wmap.values()))}): the download is incomplete")
        return wmap
    return {}


class CheckpointFilled:
    """The initial parameters of a trainer that a checkpoint overwrites next (``checkpoint.load`` writes every
    parameter element it updates, and shard padding stays zero): zeros.  A resumed rank then builds nothing of
    the model (it stays on the meta device) and holds only its shard, read from the checkpoint."""

    def piece(self, name: str, a: int, b: int) -> torch.Tensor:
        return torch.zeros(b - a, dtype=torch.float32)


def materialize(model: torch.nn.Module) -> None:
    """A model built on the meta device made real on the CPU (uninitialised parameters: the caller writes
    them), its buffers recomputed from its config where they were left on meta (rotary ``inv_freq``)."""
    from ..frontend.program import real_buffers
    if all(p.device.type != "meta" for p in model.parameters()):
        return
    buffers = real_buffers(model, "cpu")
    tied: dict[int, list[tuple[torch.nn.Module, str]]] = {}     # to_empty gives each module its own tensor
    for mod in model.modules():
        for n, p in mod.named_parameters(recurse=False):
            tied.setdefault(id(p), []).append((mod, n))
    model.to_empty(device="cpu")
    for places in tied.values():
        first = getattr(places[0][0], places[0][1])
        for mod, n in places[1:]:
            setattr(mod, n, first)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers and buffers[name].device.type != "meta":
                b.copy_(buffers[name])
