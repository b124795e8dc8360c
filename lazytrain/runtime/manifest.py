"""The checkpoint manifest (``checkpoint.json``): its shape, and the integrity of the files it lists.

The manifest is untrusted input like a plan file: ``check_manifest`` checks every field's type and range
(``jsonshape``) before anything reads it, so an edited or damaged manifest is one ``CheckpointError``
naming the field, never a KeyError or a negative step.  Each tensor file is recorded with its size, its
SHA-256 and every tensor's dtype and shape; ``read_verified`` checks all three before a tensor is used,
so a flipped byte (a weight that became 13,784.8) or a retyped tensor is refused with the file's name.

Why SHA-256: with the SHA extensions (x86 ``sha_ni``, ARMv8 crypto) it hashes 1.6 GB/s on one core of
the 2-core CI machine, twice BLAKE2b's 0.8; ``hashlib`` releases the GIL on large buffers, so saving
hashes each file on a worker thread while the next one is written, and loading hashes the next file
while the current one is loaded (measured on a Qwen2.5-3B-sized store: ``benchmarks/checkpoint_hash_cost.py``).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..util.jsonshape import Any, Either, Int, ListOf, MapOf, Num, OneOf, Opt, ShapeError, check_shape

FORMAT = "lazytrain.checkpoint/2"
#: formats of earlier versions: refused with a message that says so (they carry no checksums)
OLDER = ("lazytrain.checkpoint/0", "lazytrain.checkpoint/1")
META = "checkpoint.json"
#: tensor dtypes safetensors writes (its header names)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 16 << 20          # bytes read and hashed at a time (hashlib releases the GIL past 2 KiB)

_SHA256 = "^[0-9a-f]{64}$"
_TENSOR = {"dtype": OneOf(*DTYPES), "shape": ListOf(int)}
_FILE = {"bytes": int, "sha256": str, "tensors": MapOf(_TENSOR)}
_HYPER = {"lr": Num(), "betas": Opt(ListOf(Num(0.0, 1.0), 2)), "eps": Opt(Num()), "weight_decay": Opt(Num()),
          "max_grad_norm": Opt(Either(None, Num())), "step": Opt(int)}
_RNG = {"torch": str, "python": ListOf(Any, 3), "cuda": Opt(ListOf(str)),
        "numpy": Opt({"bit_generator": OneOf("MT19937"), "key": ListOf(Int(0, 1 << 32), 624), "pos": Int(0, 625),
                      "has_gauss": Int(0, 2), "gauss": Num(-math.inf)})}
SHAPE = {
    "format": str,
    "step": int,
    "model": {"name": str, "fingerprint": str},
    "files": MapOf(_FILE),
    "extras": ListOf(str),
    #: each extra file's SHA-256: one, or two while ``write_extra`` replaces it (the old and the new)
    "extra_sha256": Opt(MapOf(ListOf(str))),
    "optimizer": {"class": str, "hyperparameters": _HYPER, "config": MapOf(Int(1)), "block_steps": MapOf(int)},
    "grad_norm": {"consecutive_nonfinite": int, "total_nonfinite": int, "last_norm": Either(None, str)},
    "rng": _RNG,
    "plan": MapOf(Any),
    #: a checkpoint of several ranks (``checkpoint_world.py``): its world size, the shard alignment and,
    #: per rank's file, the elements [first, end) of each tensor it holds
    "world": Opt({"size": Int(2), "align": Int(1), "pieces": MapOf(MapOf(ListOf(int, 2)))}),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, truncated, another format or another model), or a
    target folder that is not a checkpoint.  The message names the file and what does not match."""


def check_manifest(meta, path: Path) -> dict:
    """``meta`` if it is a manifest of this version, else a CheckpointError naming ``path`` and the field."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: a checkpoint manifest is a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if fmt in OLDER:
        raise CheckpointError(f"{path} was written by an older version of LazyTrain (format {fmt!r}, without "
                              f"checksums); this version reads {FORMAT!r}: load it with the version that wrote it, "
                              f"or start a new run")
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: format {fmt!r}, expected {FORMAT!r}")
    try:
        check_shape(meta, SHAPE)
    except ShapeError as e:
        raise CheckpointError(f"{path}: malformed checkpoint manifest: {e}") from None
    for name, entry in meta["files"].items():
        if (not re.fullmatch(r"block_\d{4}(\.rank\d{4})?\.safetensors", name)
                or not re.fullmatch(_SHA256, entry["sha256"])):
            raise CheckpointError(f"{path}: malformed checkpoint manifest: file entry {name!r} (a name "
                                  f"block_NNNN[.rankRRRR].safetensors and a 64-digit hexadecimal sha256)")
    for name in meta["extras"]:
        if not re.fullmatch(r"[a-z_]+\.json", name):
            raise CheckpointError(f"{path}: malformed checkpoint manifest: extra file {name!r}")
    for name, digests in meta.get("extra_sha256", {}).items():
        if name not in meta["extras"] or not all(re.fullmatch(_SHA256, d) for d in digests):
            raise CheckpointError(f"{path}: malformed checkpoint manifest: extra_sha256 entry {name!r} (an extra "
                                  f"file and 64-digit hexadecimal sha256s)")
    return meta


def check_extra(path: Path, data: bytes, meta: dict) -> bytes:
    """``data``, the extra file ``path`` of the checkpoint whose manifest is ``meta``, if its SHA-256 is one the
    manifest records (a manifest without ``extra_sha256`` records none to check)."""
    digests = meta.get("extra_sha256", {}).get(path.name)
    if digests is not None and hashlib.sha256(data).hexdigest() not in digests:
        raise CheckpointError(f"{path}: sha256 {hashlib.sha256(data).hexdigest()[:16]}... differs from the "
                              f"{digests[-1][:16]}... the checkpoint recorded: the file is corrupted (or was edited)")
    return data


def extra_digests(extras: dict[str, bytes]) -> dict[str, list[str]]:
    """The manifest's ``extra_sha256`` of the extra files ``extras`` (name -> contents)."""
    return {name: [hashlib.sha256(data).hexdigest()] for name, data in sorted(extras.items())}


# ---- hashing ------------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def describe(tensors: dict[str, torch.Tensor]) -> dict:
    """Every tensor's dtype and shape, as the manifest records them."""
    return {k: {"dtype": _NAMES[t.dtype], "shape": list(t.shape)} for k, t in tensors.items()}


def hashing_pool() -> ThreadPoolExecutor:
    """Threads that hash one file while the next is written or read (two: the CI machine's cores)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="lazytrain-sha256")


def hash_async(pool: ThreadPoolExecutor, path: Path) -> Future:
    """The SHA-256 of ``path``, computed on a worker thread when the file is large (a small one is hashed
    at once: handing it to a thread costs more than hashing it).  When loading, the file's pages are
    read into the page cache once, and the load that follows maps them without another copy."""
    done: Future = Future()
    try:
        if not path.is_file():      # missing, or a FIFO or device that opening would block on or read forever
            raise FileNotFoundError(f"{path} is not a regular file")
        if path.stat().st_size > _CHUNK:
            return pool.submit(sha256_file, path)
        done.set_result(sha256_file(path))
    except OSError as e:            # a missing file: check_file says so, naming it
        done.set_exception(e)
    return done


def read_verified(path: Path, entry: dict, expected: dict[str, tuple[torch.dtype, tuple]], pending: Future
                  ) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` after checking its size, sha256 and every tensor's dtype and shape against
    the manifest ``entry`` and against ``expected`` (what the model and optimizer hold).  The file is
    hashed, then mapped: a checkpoint's files are never rewritten in place (a save writes a new folder)."""
    check_file(path, entry, pending)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    recorded = {k: (DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in entry["tensors"].items()}
    have = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    for what, got in (("the manifest", recorded), ("the file", have)):
        if got != expected:
            bad = sorted(set(got) ^ set(expected)) or [k for k in sorted(got) if got[k] != expected[k]]
            more = f" ({len(bad) - 1} more differ)" if len(bad) > 1 else ""
            raise CheckpointError(f"{path}: tensor {bad[0]} is {_show(got, bad[0])} in {what}, this model and "
                                  f"optimizer hold {_show(expected, bad[0])}{more}")
    return tensors


def check_files(folder: Path, meta: dict) -> None:
    """Every tensor file the manifest ``meta`` lists has its recorded size and SHA-256: what a reader that
    maps the files itself (``hf.export.checkpoint_weights``) checks before it reads a tensor."""
    with hashing_pool() as pool:
        pending = {name: hash_async(pool, folder / name) for name in sorted(meta["files"])}
        for name, digest in pending.items():
            check_file(folder / name, meta["files"][name], digest)


def check_file(path: Path, entry: dict, pending: Future) -> None:
    """``path``'s size and SHA-256 (``pending``: ``hash_async``'s) are the ones the manifest ``entry`` records."""
    if not path.is_file():
        what = "not a regular file" if path.exists() else "missing"
        raise CheckpointError(f"{path}: {what}, the checkpoint recorded {entry['bytes']} bytes")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, the checkpoint recorded {entry['bytes']}: truncated or "
                              f"corrupted")
    try:
        digest = pending.result()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from None
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest[:16]}... differs from the {entry['sha256'][:16]}... the "
                              f"checkpoint recorded: the file is corrupted (or was edited)")


def _show(specs: dict, key: str) -> str:
    if key not in specs:
        return "missing"
    dtype, shape = specs[key]
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"
