"""What the per-file SHA-256 of checkpoint format 2 costs, on a store the size of Qwen2.5-3B's.

A Hybrid 8-bit AdamW checkpoint holds, per parameter, the fp32 master weight and two 8-bit moments
(~6 bytes).  This writes one file per block, as ``runtime/checkpoint.py`` does (safetensors + fsync),
for the 3B shape (36 layers of 77.1 M parameters and a 311 M tied embedding: ~18.6 GB), two ways:

    plain     save_file + fsync per file (format 1)
    hashed    the same, each file hashed on a worker thread while the next is written (format 2)

(wall and CPU seconds: on a shared machine the wall time depends on what else runs) and reads them
back, each tensor copied once as into the host store: ``load_file`` (format 1) against hash, then
``load_file``, with the next file hashed meanwhile (format 2, ``manifest.read_verified``).  Read right
after writing, the files are in the page cache: the load figures are the CPU cost, not the disk.
One layer's tensors are reused for every layer (the cost does not depend on the values), so the store
needs one layer of memory, not 18 GB.

    python benchmarks/checkpoint_hash_cost.py --dir /path/with/20GB/free [--layers 36] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lazytrain.runtime.manifest import DTYPES, describe, hash_async, hashing_pool, read_verified

LAYER = 77_100_000          # Qwen2.5-3B decoder layer
EMBED = 151_936 * 2048      # its tied embedding


def _tensors(n: int) -> dict[str, torch.Tensor]:
    blocks = -(-n // 2048)
    return {"param.w": torch.randn(n), "state.mq": torch.randint(0, 255, (n,), dtype=torch.uint8),
            "state.vq": torch.randint(0, 255, (n,), dtype=torch.uint8),
            "state.m_absmax": torch.rand(blocks), "state.v_absmax": torch.rand(blocks),
            "state.step": torch.tensor([100])}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(folder: Path, files: list[tuple[str, dict]], hashed: bool) -> tuple[float, dict]:
    folder.mkdir(parents=True)
    t = time.perf_counter()
    entries = {}
    with hashing_pool() as pool:
        for name, tensors in files:
            save_file(tensors, str(folder / name), metadata={"format": "bench"})
            _fsync(folder / name)
            if hashed:
                entries[name] = (hash_async(pool, folder / name), describe(tensors))
        entries = {k: {"bytes": (folder / k).stat().st_size, "sha256": f.result(), "tensors": d}
                   for k, (f, d) in entries.items()}
    return time.perf_counter() - t, entries


def load(folder: Path, names: list[str], entries: dict | None) -> float:
    t = time.perf_counter()
    if entries is None:         # load_file maps the file lazily: the copy into the store reads it
        for name in names:
            for v in load_file(str(folder / name)).values():
                v.clone()
        return time.perf_counter() - t
    with hashing_pool() as pool:
        pending = hash_async(pool, folder / names[0])
        for i, name in enumerate(names):
            nxt = hash_async(pool, folder / names[i + 1]) if i + 1 < len(names) else None
            e = entries[name]
            expected = {k: (DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in e["tensors"].items()}
            for v in read_verified(folder / name, e, expected, pending).values():
                v.clone()       # the copy into the store, as for format 1
            pending = nxt
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a folder on the disk to measure (needs ~19 GB free at 36 layers)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    layer, embed = _tensors(LAYER), _tensors(EMBED)
    files = [("block_0000.safetensors", embed)] + [(f"block_{j:04d}.safetensors", layer)
                                                     for j in range(1, a.layers + 1)]
    names = [n for n, _ in files]
    root = Path(a.dir) / "lazytrain-hash-bench"
    shutil.rmtree(root, ignore_errors=True)
    rows = []
    for rep in range(a.reps):
        for hashed in (False, True):
            folder = root / f"{'hashed' if hashed else 'plain'}{rep}"
            cpu = time.process_time()
            save_s, entries = save(folder, files, hashed)
            save_cpu, cpu = time.process_time() - cpu, time.process_time()
            gb = sum((folder / n).stat().st_size for n in names) / 1e9
            load_s = load(folder, names, entries if hashed else None)
            rows.append({"rep": rep, "hashed": hashed, "gb": round(gb, 2), "save_s": round(save_s, 2),
                         "save_cpu_s": round(save_cpu, 2), "load_s": round(load_s, 2),
                         "load_cpu_s": round(time.process_time() - cpu, 2), "load_average": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(folder)
    for hashed in (False, True):
        r = [x for x in rows if x["hashed"] is hashed]
        print(f"{'hashed' if hashed else 'plain '}: save {min(x['save_s'] for x in r):.1f} s "
              f"({min(x['save_cpu_s'] for x in r):.1f} s CPU), load {min(x['load_s'] for x in r):.1f} s "
              f"({min(x['load_cpu_s'] for x in r):.1f} s CPU) (best of {len(r)}, {r[0]['gb']} GB)")


if __name__ == "__main__":
    main()
