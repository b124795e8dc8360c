"""NVMe tier I/O rates: read, write and both at once (GB/s) through ``runtime/nvme.py``, direct vs buffered.

    PYTHONPATH=. python benchmarks/nvme_io.py --dir DIR [--size 256MiB] [--repeats 2] [--out benchmarks/results/nvme_io]

Each row is ``lazytrain.measure.disk.disk_rates`` (what ``lazytrain profile`` records): two preallocated files of
``--size`` in ``--dir``, overwritten in place from a 4096-aligned buffer with an fsync, read back with the page
cache dropped, and one read while the other is written; median of ``--repeats``.  It sweeps the request size at the
runtime's queue depth (``QUEUE_DEPTH``) and the queue depth at the runtime's request size (``REQUEST_BYTES``), once
with ``O_DIRECT`` (where the folder's file system takes it) and once buffered (``posix_fadvise(DONTNEED)`` after each
request).  Writes ``results.json`` and ``table.md`` under ``--out``; the README there says on which machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from lazytrain.measure.disk import disk_rates
from lazytrain.runtime.nvme import QUEUE_DEPTH, REQUEST_BYTES
from lazytrain.util.units import parse_size

MiB = 2**20
REQUEST_SIZES = (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
DEPTHS = (1, 2, 4, 8, 16)


def _file_system(path: Path) -> str:
    """The type and device of the mount holding ``path`` (from /proc/mounts; "?" elsewhere)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    path = path.resolve()
    best = max((m for m in mounts if path.is_relative_to(m[1])), key=lambda m: len(m[1]), default=None)
    return f"{best[2]} on {best[0]}" if best else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="folder on the disk to measure (files are removed after)")
    ap.add_argument("--size", default="256MiB", help="bytes of each of the two files")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    a = ap.parse_args()
    nbytes = parse_size(a.size)
    folder = Path(a.dir)
    settings = sorted({(r, QUEUE_DEPTH) for r in REQUEST_SIZES} | {(REQUEST_BYTES, d) for d in DEPTHS},
                      key=lambda s: (s[0] != REQUEST_BYTES, s))
    rows = []
    for mode in ("direct", "buffered"):
        for request, depth in settings:
            r = disk_rates(folder, nbytes, request_bytes=request, queue_depth=depth,
                           direct=None if mode == "direct" else False, repeats=a.repeats)
            if mode == "direct" and not r["direct"]:
                print(f"{folder} does not take O_DIRECT: no direct rows", file=sys.stderr)
                break
            rows.append({"mode": mode, "request_mib": request // MiB, "queue_depth": depth,
                         **{k: round(r[k], 3) for k in ("nvme_read_gbps", "nvme_write_gbps", "nvme_both_gbps")}})
            print(rows[-1], flush=True)
    table = ["| I/O | request | in flight | read GB/s | write GB/s | both at once GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r['mode']} | {r['request_mib']} MiB | {r['queue_depth']} | {r['nvme_read_gbps']:.2f} | "
              f"{r['nvme_write_gbps']:.2f} | {r['nvme_both_gbps']:.2f} |" for r in rows]
    print("\n".join(table))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "file_system": _file_system(folder),
                   "file_bytes": nbytes, "repeats": a.repeats}
        (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
        (out / "table.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
