"""The files of a ``lazytrain train`` run: one commit point for checkpoint + metrics, and resuming from it.

An output folder holds ``checkpoint/`` and ``metrics.json``.  The metrics that count are the copy
*inside* the checkpoint (``checkpoint/metrics.json``), written in the same atomic commit as the
tensors (``runtime/checkpoint.py``: temporary folder, fsync, rename), so a kill at any moment leaves
the previous complete state or the new one, never a checkpoint of step 40 with metrics of step 21:

    commit 1   checkpoint + metrics (final eval pending)     -- after training
    commit 2   metrics with the exact match (one rename)     -- after the final eval

A run killed during its final eval is resumable from commit 1 (the resume evaluates).  The top-level
``metrics.json`` is a copy for people and plots, refreshed after each commit; ``--resume`` never reads it.

``--resume`` rebuilds the model from what the run recorded as data: a preset's or a Hugging Face
config (never weights from a path, never code).  A run of a ``package.module:factory`` model needs
``allow_factory`` (``--allow-factory``): the factory is code, and a run folder may come from anyone.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from ..runtime import checkpoint
from ..runtime.checkpoint import read_extra, read_meta, resolve
from ..runtime.manifest import CheckpointError
from ..util.atomic import replace_file, staged_files
from ..util.jsonshape import Any, Either, Int, ListOf, MapOf, Num, OneOf, Opt, ShapeError, check_shape, dumps
from .config import UNIT, TrainConfig, asked, recorded, resumed, resumed_shapes, setting_of

METRICS = "metrics.json"
METRICS_FORMAT = "lazytrain.train-metrics/1"
_SETTINGS = resumed_shapes(TrainConfig())
_LOSS = Either(None, Num(-math.inf, finite=False, nan=True))     # null: not finite (``jsonshape.dumps``)
SHAPE = {
    "format": OneOf(METRICS_FORMAT),
    "settings": _SETTINGS,
    "model": Either({"config": MapOf(Any), "pretrained": Opt(str)}, {"spec": str}),
    "steps_done": int,
    "tokens": int,
    "train_s": Num(),
    "loss_curve": ListOf({"step": Int(1), "loss": _LOSS, "lr": Num(), "grad_norm": _LOSS, "step_s": Num(),
                          "t": Num()}),
    "eval_curve": ListOf({"step": int, "exact_match": Num(0.0, UNIT), "n": int}),
}


def write_json(path: Path, data: dict) -> None:
    """``path`` in a run folder replaced atomically (temporary file, fsync, rename): never half-written, and a link at
    ``path`` is replaced, never written through."""
    replace_file(path, dumps(data, indent=1))


def plot_into(path: Path, curves: dict, *, title: str) -> None:
    """``compiler.timeline.plot_loss`` to ``path`` in a run folder, as ``write_json`` writes: a new file renamed over
    the name (matplotlib opens the path it is given, and would write through a link)."""
    from ..compiler.timeline import plot_loss
    with staged_files(path.parent, path.name) as tmp:
        plot_loss(tmp / path.name, curves, title=title)


def commit(trainer, out: Path, metrics: dict, *, main: bool = True, name: str = "checkpoint") -> Path:
    """Commit 1: the trainer's state and ``metrics`` in one atomic checkpoint (``out/name``: a periodic one is
    ``checkpoint-STEP``, ``saves.py``); then the copy (``main``: the rank that writes it; with several ranks every one
    calls this, rank 0's metrics are committed)."""
    ckpt = checkpoint.save(trainer, out / name, extras={METRICS: _encode(metrics)})
    if main:
        write_json(out / METRICS, metrics)
    return ckpt


def update_metrics(out: Path, metrics: dict) -> None:
    """Commit 2: the checkpoint's metrics replaced in one rename; then the copy."""
    checkpoint.write_extra(out / "checkpoint", METRICS, _encode(metrics))
    write_json(out / METRICS, metrics)


def _encode(metrics: dict) -> bytes:
    return dumps(metrics, indent=1).encode()


def resume_checkpoint(cfg: TrainConfig) -> Path:
    """The checkpoint folder a resume of ``cfg`` reads: the one ``saves.pick`` chose (the run folder's newest
    complete one), else ``cfg.resume``'s ``checkpoint/``."""
    return Path(cfg.resumed_checkpoint) if cfg.resumed_checkpoint else Path(cfg.resume) / "checkpoint"


def load_resume(cfg: TrainConfig) -> tuple[TrainConfig, dict]:
    """``(cfg with the run's settings, the run's metrics)`` from the checkpoint of ``cfg.resume``; every
    field checked (``SHAPE``) and the metrics checked against the checkpoint they were committed with."""
    src, ckpt = Path(cfg.resume), resume_checkpoint(cfg)
    try:
        resolve(ckpt)
    except CheckpointError:
        raise FileNotFoundError(f"--resume {src}: expected an output folder of `lazytrain train` (a checkpoint/ "
                                f"folder)") from None
    folder, meta = read_meta(ckpt)
    mpath = folder / METRICS
    try:
        prev = json.loads(read_extra(folder, meta, METRICS).decode("utf-8"))
        check_shape(prev, SHAPE)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:    # JSONDecodeError, ShapeError: ValueErrors
        why = str(e) if isinstance(e, ShapeError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"--resume {src}: {mpath} is not the metrics of a `lazytrain train` run ({why})") from None
    done, curve = prev["steps_done"], prev["loss_curve"]
    if done != meta["step"] or [h["step"] for h in curve] != list(range(1, done + 1)):
        raise ValueError(f"--resume {src}: {mpath} records {done} steps and a loss curve of {len(curve)}, the "
                         f"checkpoint step {meta['step']}: the files were edited, they do not belong together")
    nan_losses(curve)
    take_settings(cfg, prev["settings"], src)
    if cfg.steps < done:
        raise ValueError(f"--resume {src}: the run is already at step {done}; --steps is the total to reach, "
                         f"not an increment (ask for more than {done})")
    if "spec" in prev["model"] and not cfg.allow_factory:
        raise ValueError(f"--resume {src}: the run's model is built by the factory {prev['model']['spec']!r}, and "
                         f"resuming would import and run it (code named in {mpath}); pass --allow-factory if you "
                         f"trust this run folder")
    return cfg, prev


def nan_losses(curve: list) -> list:
    """A loss curve as read from metrics.json with its nulls (``jsonshape.dumps``: a loss or gradient norm that
    was not finite) NaN again, as the run held them; in place."""
    for h in curve:
        if isinstance(h, dict):
            h.update({k: math.nan for k in ("loss", "grad_norm") if k in h and h[k] is None})
    return curve


def take_settings(cfg: TrainConfig, saved: dict, src: Path) -> None:
    """``cfg`` with the settings of the run it resumes (``saved``, its ``metrics.json``'s): every one it kept
    (``resumed``) or carried (``carried``) comes from the run unless this command line gave its flag (``asked``);
    a flag asking another value of a kept one is an error, of a carried one a change, said on the console.  The
    rest (the machine, where to write) is this command's."""
    default, given = type(cfg)(), asked(cfg)
    kept, changed = set(resumed(cfg)), []
    for f in fields(cfg):
        k, s = f.name, setting_of(f)
        if k not in kept and cfg.runs not in s.carried:
            continue
        v, now = saved.get(k, getattr(default, k)), getattr(cfg, k)     # (a setting newer than the run)
        if k not in given or _same(now, v):
            setattr(cfg, k, v)
            continue
        flag = s.flag_name(k) if s.const is not None and s.nargs is None else f"{s.flag_name(k)} {now}"
        if k in kept:
            raise ValueError(f"--resume {src}: {flag} differs from the run's {k} ({v}); a resumed run keeps its "
                             f"settings (leave the flag out, or start a new run)")
        changed.append(f"{k} {v} -> {now}")
    if changed:
        print(f"--resume {src}: changed on this command line: {', '.join(changed)}; the rest as the run had it")


def _same(a, b) -> bool:
    """Are two values of a setting the same (a file or folder given by another relative path is)?"""
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def settings(cfg: TrainConfig, seq: int) -> dict:
    """The run's settings as metrics.json records them (``seq`` as the run uses it: the difficulty's when not
    given)."""
    return recorded(cfg) | {"seq": seq}
