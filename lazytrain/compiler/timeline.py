"""Chrome / Perfetto trace JSON and a memory-over-time plot of a predicted (or measured) timeline."""

from __future__ import annotations

import json
from pathlib import Path

from ..ir import GiB, Plan

LANES = {"gpu": 1, "h2d": 2, "d2h": 3, "cpu": 4, "nvme": 5}


def chrome_trace(plan: Plan, start: list[float], end: list[float], *, name: str = "predicted",
                 memory: list[tuple[float, int]] | None = None, resources: list[str] | None = None) -> dict:
    """One lane per resource (``X`` complete events in microseconds) plus a GPU-memory counter.
    ``resources`` overrides each op's lane (a measured trace knows where an op really ran)."""
    ev: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"lazytrain {name}"}}]
    for lane, tid in LANES.items():
        ev.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": lane}})
    for op in plan.ops:
        res = resources[op.id] if resources else op.resource.value
        if res == "none" or end[op.id] <= start[op.id]:
            continue
        label = f"{op.kind.value} {op.tensor if op.tensor is not None else f'block[{op.block}]'}"
        if op.mb is not None and op.tensor is None:
            label += f" mb{op.mb}"
        ev.append({"ph": "X", "pid": 1, "tid": LANES.get(res, 6), "name": label, "ts": start[op.id] * 1e6,
                   "dur": (end[op.id] - start[op.id]) * 1e6,
                   "args": {"op": op.id, "block": op.block, "mb": op.mb, "bytes": op.nbytes}})
    for t, b in memory or []:
        ev.append({"ph": "C", "pid": 1, "name": "GPU memory (GiB)", "ts": t * 1e6, "args": {"GiB": b / GiB}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"model": plan.graph.name, "batch": plan.batch_size, "policy": plan.decisions.policy}}


def write_trace(path: str | Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace))


def plot_memory(path: str | Path, curves: dict[str, list[tuple[float, int]]], *, budget: int | None = None,
                title: str = "GPU memory over one step") -> None:
    """Step plot of GPU bytes over time, one line per curve (e.g. predicted, measured)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install 'lazytrain[plot]'") from e
    fig, ax = plt.subplots(figsize=(10, 4))
    for label, pts in curves.items():
        if pts:
            ax.step([t * 1e3 for t, _ in pts], [b / GiB for _, b in pts], where="post", label=label)
    if budget:
        ax.axhline(budget / GiB, color="red", linestyle="--", label="budget")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
