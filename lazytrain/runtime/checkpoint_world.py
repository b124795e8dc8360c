"""Checkpoints of several ranks: one folder for the world, one file per block and rank, resumable at
another world size.

Layout (format ``"lazytrain.checkpoint/2"``, as ``checkpoint.py``; what differs)::

    checkpoint.json                 the manifest, plus ``world``: the world size, the shard alignment
                                    (``ir.sharding.ALIGN``) and, per file, the elements ``[first, end)``
                                    of each tensor that file holds
    block_0000.rank0000.safetensors rank 0's shard of block 0:
                                      param.<name>  fp32 master of its piece of the tensor (flat)
                                      state.<key>   the rest of HostOptimizer.state_tensors(block), as
                                                    the rank's optimizer holds it for its shard

Atomic for the whole world: rank 0 makes ``<dir>.tmp-world``; after a barrier every rank writes its
files there and a part of the manifest (``files.rankRRRR.json``: its files' sizes, SHA-256 and
tensors); after a second barrier rank 0 merges the parts into ``checkpoint.json`` and commits the
folder with ``util.atomic.commit_folder``'s two renames; a third barrier holds every rank until the commit is done.
A rank that dies before the second barrier makes the others' barrier fail (``RankFailure``): nothing
was renamed, the previous checkpoint is untouched, and the next save (or commit) removes the temporary
folder.  RNG states and the gradient-norm counters are rank 0's (every rank draws the same numbers).

Loading into a world of the same size reads each rank's own files.  Into another size (one process
included, and a one-process checkpoint into several ranks) every rank reads the old files whose
pieces overlap its shard, cuts them into per-tensor pieces, and re-slices (``reshard.py``: exact for
AdamW and Hybrid 8-bit AdamW, whose quantization blocks the shard alignment preserves).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..ir import ModelGraph
from ..ir.sharding import ALIGN
from ..util.atomic import commit_folder, fsync_dir, write_synced
from . import reshard
from .manifest import DTYPES, META, CheckpointError, extra_digests, hash_async, hashing_pool, read_verified
from .shards import gathered_layouts, owned_pieces, shard_layouts
from .store import layouts

#: a rank's file-name suffix and its part of the manifest
_SUFFIX = ".rank{:04d}"
_PART = "files.rank{:04d}.json"


# ---- saving -------------------------------------------------------------------------------------------
def save(trainer, target: Path, extras: dict[str, bytes] | None, write: Callable[[object, Path, str], dict]) -> Path:
    """Every rank calls this (a collective); see the module docstring.  ``write(trainer, folder, suffix)`` writes
    the rank's tensor files and returns its manifest (``checkpoint._write``)."""
    world = trainer.world
    trainer.flush()
    tmp = target.with_name(f"{target.name}.tmp-world")
    if world.rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)      # left by a save of the world that failed
        tmp.mkdir()
    world.barrier("the checkpoint's first barrier (its folder made)")
    meta = write(trainer, tmp, _SUFFIX.format(world.rank))
    pieces_of = {name: _file_pieces(trainer, name) for name in meta["files"]}
    write_synced(tmp / _PART.format(world.rank), json.dumps({"files": meta["files"], "pieces": pieces_of}).encode())
    try:
        world.barrier("the checkpoint's second barrier (every rank's files written)")
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world.rank == 0:
        files, every = {}, {}
        for r in range(world.size):
            part = json.loads((tmp / _PART.format(r)).read_text())
            files.update(part["files"])
            every.update(part["pieces"])
            (tmp / _PART.format(r)).unlink()
        meta["files"], meta["world"] = files, {"size": world.size, "align": ALIGN, "pieces": every}
        for name, data in sorted((extras or {}).items()):
            write_synced(tmp / name, data)
        meta["extras"], meta["extra_sha256"] = sorted(extras or {}), extra_digests(extras or {})
        write_synced(tmp / META, json.dumps(meta, allow_nan=False).encode())
        fsync_dir(tmp)
        commit_folder(tmp, target)
    world.barrier("the checkpoint's last barrier (committed by rank 0)")
    return target


def _file_pieces(trainer, name: str) -> dict[str, list[int]]:
    j = int(name[len("block_"):len("block_") + 4])
    return {seg.name: [a, b] for seg, a, b in owned_pieces(trainer._gathered[j], trainer.world.size,
                                                           trainer.world.rank)}


# ---- the layouts of a world -----------------------------------------------------------------------------
def _shards(graph: ModelGraph, size: int) -> list[list[tuple[str, list, dict[str, tuple[int, int]]]]]:
    """Per block, per rank of a world of ``size``: (file name, the optimizer's segments, the elements
    of each tensor it holds).  A world of one: the dense layout, whole tensors, no rank suffix."""
    if size == 1:
        out = []
        for lay in layouts(graph):       # a block's file holds what it updates (tied links are their owner's)
            rng = {s.name: (0, s.numel) for s in lay.segments if s.offset < lay.owned_numel}
            out.append([(f"block_{lay.index:04d}.safetensors", lay.opt_segments(), rng)] if lay.owned_numel else [])
        return out
    gathered = gathered_layouts(graph, size)
    per_rank = [shard_layouts(gathered, size, r) for r in range(size)]
    out = []
    for j, lay in enumerate(gathered):
        out.append([(f"block_{j:04d}{_SUFFIX.format(r)}.safetensors", per_rank[r][j].opt_segments(),
                     {seg.name: (a, b) for seg, a, b in owned_pieces(lay, size, r)})
                    for r in range(size) if per_rank[r][j].owned_numel])
    return out


# ---- loading ------------------------------------------------------------------------------------------
def load_blocks(trainer, folder: Path, meta: dict, load_block) -> None:
    """Every block's state of this rank from the checkpoint at ``folder`` (any world size)."""
    with hashing_pool() as pool:
        _load_blocks(trainer, folder, meta, load_block, pool)


def _load_blocks(trainer, folder: Path, meta: dict, load_block, pool) -> None:
    graph = trainer.plan.graph
    saved = meta.get("world", {}).get("size", 1)
    old = _shards(graph, saved)
    if saved > 1:
        recorded = meta["world"]["pieces"]
        computed = {f: {k: list(v) for k, v in rng.items()} for blk in old for f, _segs, rng in blk}
        if meta["world"]["align"] != ALIGN or recorded != computed:
            raise CheckpointError(f"{folder / META}: the shard layout it records is not the one this version computes "
                                  f"for world size {saved} (alignment {meta['world']['align']}, this version "
                                  f"{ALIGN}): load it with the version that wrote it")
    want = {f for blk in old for f, _s, _r in blk}
    if set(meta["files"]) != want:
        raise CheckpointError(f"{folder / META} lists files {sorted(meta['files'])[:4]}..., a checkpoint of world size "
                              f"{saved} of this model has {sorted(want)[:4]}...")
    size = 1 if trainer.world is None else trainer.world.size
    rank = 0 if trainer.world is None else trainer.world.rank
    opt = trainer.optimizer
    if saved == size:              # the same layout: each rank reads its own files
        for j, lay in enumerate(trainer.store.layouts):
            for f, _segs, _rng in old[j][rank:rank + 1] if saved > 1 else old[j]:
                load_block(opt, j, lay, folder / f, meta["files"][f], hash_async(pool, folder / f), pieces=saved > 1)
        return
    reshard.check_reshardable(opt)
    new = _shards(graph, size)
    for j, lay in enumerate(trainer.store.layouts):
        if not lay.owned_numel:
            continue
        _file, segs, rng = new[j][rank] if size > 1 else new[j][0]
        needed = [(f, s, r) for f, s, r in old[j] if any(_overlap(r.get(n), ab) for n, ab in rng.items())]
        got = [(r, _split(opt, folder, f, meta["files"][f], s, pool)) for f, s, r in needed]
        parts = {}
        for name, (a, b) in rng.items():
            have = [(r[name][0], r[name][1], p[name]) for r, p in got if _overlap(r.get(name), (a, b))]
            if not have:
                raise CheckpointError(f"{folder}: no saved piece holds elements [{a}, {b}) of {name}")
            parts[name] = reshard.cut(opt, have, a, b)
        state = reshard.join(opt, opt.state_tensors(j), segs, parts)
        try:
            opt.load_state_tensors(j, state)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{folder}: optimizer state does not fit block {j}: {type(e).__name__}: {e}") \
                from None


def _overlap(r, ab) -> bool:
    return r is not None and max(r[0], ab[0]) < min(r[1], ab[1])


def _split(opt, folder: Path, name: str, entry: dict, segs: list, pool) -> dict:
    """One old file's state as per-tensor pieces (``reshard.split``); the file checked against its
    manifest entry (size, SHA-256, dtypes and shapes), its pieces against the layout."""
    expected = {k: (DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in entry["tensors"].items()}
    tensors = read_verified(folder / name, entry, expected, hash_async(pool, folder / name))
    master = torch.zeros(max((off + n for _nm, off, n, _sh in segs), default=0), dtype=torch.float32)
    for nm, off, n, _sh in segs:
        t = tensors.pop(f"param.{nm}", None)
        if t is None or t.numel() != n:
            raise CheckpointError(f"{folder / name}: tensor param.{nm} is missing or not of the {n} elements "
                                  "the layout holds")
        master[off:off + n] = t.reshape(-1)
    state = {k.removeprefix("state."): v for k, v in tensors.items()}
    state["master"] = master
    try:
        return reshard.split(opt, state, segs)
    except KeyError as e:
        raise CheckpointError(f"{folder / name}: state {e.args[0]} missing: saved by another optimizer") from None
