"""Chrome / Perfetto trace JSON of one step, predicted (the simulator's) or measured (a
``StepProfile``), and plots: GPU memory over the step, loss over training."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..ir import GiB, Plan
from .simulate import simulate

LANES = {"gpu": 1, "h2d": 2, "d2h": 3, "cpu": 4, "nvme": 5}


def chrome_trace(plan: Plan, start: list[float], end: list[float], *, name: str = "predicted",
                 memory: list[tuple[float, int]] | None = None) -> dict:
    """The predicted timeline: ``start`` / ``end`` per op id (``simulate``), each op on its resource."""
    spans = [(op.id, op.resource.value, start[op.id], end[op.id]) for op in plan.ops
             if op.resource.value != "none" and end[op.id] > start[op.id]]
    return _trace(plan, spans, name, memory)


def measured_trace(plan: Plan, profile, *, name: str = "measured") -> dict:
    """A measured step (``runtime.profiling.StepProfile``): every op the profiler timed, on the resource it
    ran on, and the measured memory curve.  Frees and skipped updates take no time and are not timed."""
    return _trace(plan, profile.trace, name, profile.memory, step_s=profile.step_s)


def _trace(plan: Plan, spans: Iterable[tuple[int, str, float, float]], name: str,
           memory: list[tuple[float, int]] | None, **other) -> dict:
    """One lane per resource (``X`` complete events in microseconds, each named by its op's one-line
    print) plus a GPU-memory counter."""
    ev: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"lazytrain {name}"}}]
    for lane, tid in LANES.items():
        ev.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": lane}})
    for i, res, a, b in spans:
        op = plan.ops[i]
        ev.append({"ph": "X", "pid": 1, "tid": LANES.get(res, 6), "name": " ".join(str(op).split()),
                   "ts": a * 1e6, "dur": (b - a) * 1e6,
                   "args": {"op": op.id, "block": op.block, "mb": op.mb, "bytes": op.nbytes,
                            "predicted_ms": op.seconds * 1e3}})
    for t, n in memory or []:
        ev.append({"ph": "C", "pid": 1, "name": "GPU memory (GiB)", "ts": t * 1e6, "args": {"GiB": n / GiB}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"model": plan.graph.name, "batch": plan.batch_size, "policy": plan.decisions.policy,
                          "timeline": name, **other}}


def write_trace(path: str | Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace))


def write_step(plan: Plan, trace_path: str | Path, *, plot: str | Path | None = None, profile=None) -> list[str]:
    """What ``lazytrain trace`` writes: the predicted trace, or with ``profile`` (a ``StepProfile`` already
    checked against ``plan``) the measured one; with ``plot``, a memory PNG with the predicted curve, the
    measured one if the profile has it, and the budget.  Returns what to tell the user."""
    sim = simulate(plan)
    curves = {"predicted": sim.memory}
    if profile is None:
        write_trace(trace_path, chrome_trace(plan, sim.start, sim.end, memory=sim.memory))
    else:
        write_trace(trace_path, measured_trace(plan, profile))
    notes = [f"wrote {trace_path} (open in https://ui.perfetto.dev)"]
    if profile is not None and not profile.memory:
        notes.append("the profile holds no memory samples (a CPU-mode step outside runtime.memtrack.track): "
                     "only the predicted curve is plotted")
    if plot:
        if profile is not None and profile.memory:
            curves["measured"] = profile.memory
        plot_memory(plot, curves, budget=plan.budgets.get("gpu_bytes"))
        notes.append(f"wrote {plot}")
    return notes


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib (lazytrain's 'plot' extra)") from e
    return plt


def plot_memory(path: str | Path, curves: dict[str, list[tuple[float, int]]], *, budget: int | None = None,
                title: str = "GPU memory over one step") -> None:
    """Step plot of GPU bytes over time, one line per curve (e.g. predicted, measured), in GiB, MiB or KiB
    by the curves' size; the budget is a line, or a note when it is far above the curves (a tiny model)."""
    plt = _pyplot()
    top = max((b for pts in curves.values() for _, b in pts), default=0)
    unit, scale = next((u, s) for u, s in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if max(top, 1) >= s)
    fig, ax = plt.subplots(figsize=(10, 4))
    for label, pts in curves.items():
        if pts:
            ax.step([t * 1e3 for t, _ in pts], [b / scale for _, b in pts], where="post", label=label)
    if budget and (not top or budget <= 3 * top):
        ax.axhline(budget / scale, color="red", linestyle="--", label="budget")
    elif budget:
        ax.text(0.01, 0.97, f"budget {budget / GiB:.2f} GiB (off the scale)", transform=ax.transAxes, va="top",
                color="red")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel(f"GPU memory ({unit})")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(path: str | Path, curves: dict[str, list[tuple[int, float]]], *, title: str | None = None) -> None:
    """Loss against optimizer step, one line per curve (e.g. lazytrain and plain PyTorch on the same
    data); the y axis is logarithmic when the losses are positive and span more than a factor of 10."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    ys = [y for pts in curves.values() for _, y in pts]
    for label, pts in curves.items():
        if pts:
            ax.plot([s for s, _ in pts], [y for _, y in pts], label=label, marker="." if len(pts) < 50 else None)
    if ys and min(ys) > 0 and max(ys) > 10 * min(ys):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    if curves:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
