"""Periodic checkpoints (``--save-steps N``), how many of them stay (``--save-total-limit K``), and which checkpoint a
resume reads (``--resume DIR``, ``--resume-from-checkpoint [PATH]``, ``lazytrain export RUN``).

A run folder with periodic checkpoints::

    OUTPUT/checkpoint-4/        commit at step 4: the trainer's state + metrics.json as of step 4
    OUTPUT/checkpoint-6/        commit at step 6
    OUTPUT/checkpoint/          the final commit, as a run without --save-steps writes it
    OUTPUT/metrics.json         the copy for people, refreshed after every commit

Why this layout.  The final commit stays where it was: ``--resume``, ``lazytrain export`` and every tool and script
that reads ``OUTPUT/checkpoint/`` go on working, and a run without ``--save-steps`` writes what it always wrote.  A
periodic one is a folder of its own named as Hugging Face's ``Trainer`` names them (``checkpoint-500``): each one is
committed exactly as the final one (``runfiles.commit``: temporary folder, fsync, rename; with several ranks each
rank writes its shards and rank 0 commits), complete and self-contained (its metrics inside it, checked by SHA-256),
so any one of them can be resumed or exported alone, and a kill at any moment leaves every committed one intact.
One folder overwritten in place every N steps would have been the other choice: it keeps no history to go back to,
and the one state it holds is the one a diverged run would want to go back from.

No periodic save at the run's last step: the final commit follows at once with the same state.  The save runs
after the step's evaluation (``--eval-every``), so its metrics hold that evaluation.  Each save prints one line with
its seconds (a large model's host state is written to disk) and is recorded in the metrics (``saves``: step and
``save_s``); the time limit still counts them.

``--save-total-limit K`` deletes the oldest periodic checkpoints beyond the newest K, only after the new one is
committed.  Counted and deleted are only ours: real folders (a symbolic link is neither followed nor deleted) named
``checkpoint-STEP`` that hold a manifest; a staging folder (``*.tmp-*``) is never one of them.  A folder is first
renamed to a staging name, then removed, so a kill during the removal leaves a staging folder (removed when the next
run claims the folder) and never a half-deleted checkpoint under a checkpoint's name.

A resume of a run folder reads its newest complete checkpoint: the final one or a periodic one, whichever has the
most steps (the final one on a tie: it may hold the final evaluation), whose manifest, tensor files and extra files
match their SHA-256; one that does not is skipped with a line saying so, and the next newest is tried.  A run killed
between two saves thus resumes from its latest: the metrics committed inside each checkpoint hold the loss curve up
to that checkpoint's step, which both resumes check against the checkpoint's step.  The check reads every file
once before the load reads it again (a 7B model's ~60 GB: a minute on NVMe), the price of falling back before the
model is built rather than failing after.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ..runtime.checkpoint import META, read_extra, read_meta
from ..runtime.manifest import CheckpointError, check_files
from . import runfiles
from .config import TrainConfig
from .session import note

#: a periodic checkpoint's folder, and the folder a save that died between its two renames leaves
PERIODIC = re.compile(r"checkpoint-(\d+)")
_OLD = re.compile(r"checkpoint(?:-\d+)?\.old")


class Saver:
    """The periodic saves of one run: ``step`` after every optimizer step commits a checkpoint every
    ``cfg.save_steps`` steps; ``stamp`` puts the record of the saves into a metrics dict.  ``metrics``: the
    run's metrics as of now (``final_eval`` pending); ``prev``: what a resumed run committed (its saves go on)."""

    def __init__(self, cfg: TrainConfig, trainer, out: Path, metrics: Callable[[], dict], *, main: bool = True,
                 prev: dict | None = None):
        self.every, self.last, self.keep = cfg.save_steps, cfg.steps, cfg.save_total_limit
        self.trainer, self.out, self.metrics, self.main = trainer, out, metrics, main
        self.saves: list[dict] = list((prev or {}).get("saves") or [])
        if prev is None and main:       # a new run (--overwrite): the old run's would be taken for this one's
            gone = prune(out, 0)
            if gone:
                print(f"removed the periodic checkpoints of the run --overwrite replaces: {', '.join(gone)}")

    def stamp(self, metrics: dict) -> dict:
        """``metrics`` with the saves so far (``saves``: step and seconds of each)."""
        metrics["saves"] = list(self.saves)
        return metrics

    def step(self, step: int, bar=None) -> None:
        """After step ``step``: the periodic commit when one is due, its line on the console, then the pruning."""
        if not self.every or step % self.every or step >= self.last:
            return
        name = f"checkpoint-{step}"
        metrics = self.stamp(self.metrics())
        metrics["checkpoint"] = str(self.out / name)
        t = time.perf_counter()
        runfiles.commit(self.trainer, self.out, metrics, main=self.main, name=name)
        save_s = time.perf_counter() - t
        self.saves.append({"step": step, "save_s": round(save_s, 3)})
        gone = prune(self.out, self.keep, keep_also=name) if self.main and self.keep else []
        if self.main:
            note(bar, f"step {step}: saved {self.out / name} in {save_s:.2f} s"
                      + (f"; removed {', '.join(gone)} (--save-total-limit {self.keep})" if gone else ""))


def periodic(out: Path) -> list[tuple[int, Path]]:
    """The complete periodic checkpoints in ``out`` by step: real folders ``checkpoint-STEP`` holding a manifest
    that is a regular file (never a link, a staging folder, or a folder of that name that is not ours)."""
    found = []
    with os.scandir(out) as entries:
        for e in entries:
            m = PERIODIC.fullmatch(e.name)
            if m and e.is_dir(follow_symlinks=False) and _is_manifest(Path(e.path) / META):
                found.append((int(m[1]), Path(e.path)))
    return sorted(found)


def _is_manifest(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def prune(out: Path, keep: int, *, keep_also: str | None = None) -> list[str]:
    """Delete the complete periodic checkpoints of ``out`` beyond the newest ``keep`` (never ``keep_also``, the
    one just committed); each renamed to a staging name first (see the module docstring).  Returns their names."""
    gone, found = [], periodic(out)
    for _, path in found[:len(found) - keep]:
        if path.name == keep_also:
            continue
        doomed = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        gone.append(path.name)
    return gone


def settle(cfg: TrainConfig) -> None:
    """``cfg.resume`` (the run folder) from ``resume_from_checkpoint``: ``True`` (or "true"), ``--output``; a path,
    that run folder, or the run folder around that checkpoint folder (``resumed_checkpoint``).  Before the run claims
    its folder (a resume of ``--output`` is no run over another run)."""
    want = cfg.resume_from_checkpoint
    if isinstance(want, str) and want.strip().lower() in ("true", "false"):
        want = want.strip().lower() == "true"
    if want is None or want is False:
        return
    if cfg.resume:
        raise ValueError(f"--resume {cfg.resume} and --resume-from-checkpoint {want}: both name what to resume; "
                         f"give one")
    if want is True:
        cfg.resume = cfg.output
        return
    path = Path(want)
    if (path / META).is_file() or (path.with_name(path.name + ".old") / META).is_file():
        cfg.resume, cfg.resumed_checkpoint = str(path.parent), str(path)
    elif path.is_dir():
        cfg.resume = str(path)
    else:
        raise FileNotFoundError(f"--resume-from-checkpoint {want}: neither a run folder (OUTPUT of lazytrain "
                                f"train) nor a checkpoint folder (with {META})")


def pick(cfg: TrainConfig) -> None:
    """``cfg.resumed_checkpoint``: the newest complete checkpoint of the run folder ``cfg.resume`` (``newest``),
    unless one was named; left None when the folder has none at all (the resume then says what it expected)."""
    if cfg.resume and not cfg.resumed_checkpoint:
        found = newest(Path(cfg.resume), "--resume")
        cfg.resumed_checkpoint = str(found) if found is not None else None


def newest(run: Path, flag: str) -> Path | None:
    """The newest checkpoint of the run folder ``run`` that checks out (see the module docstring), None when it has
    none at all; a ``CheckpointError`` when it has some and none checks out."""
    if not run.is_dir():
        return None
    found, bad = [], []
    for path in _candidates(run):
        try:
            meta = read_meta(path)[1]
        except CheckpointError as e:
            bad.append(f"{path.name}: {e}")
            continue
        found.append((meta["step"], path.name == "checkpoint", path))
    for line in bad:
        print(f"{flag} {run}: skipped {line}")
    for step, _, path in sorted(found, key=lambda f: f[:2], reverse=True):
        try:
            verify(path)
        except CheckpointError as e:
            bad.append(f"{path.name}: {e}")
            print(f"{flag} {run}: {path.name} (step {step}) does not check out, falling back to the next newest "
                  f"checkpoint: {e}")
            continue
        print(f"{flag} {run}: reading {path.name} (step {step})")
        return path
    if bad:
        raise CheckpointError(f"{flag} {run}: no checkpoint in it checks out: {'; '.join(bad)}")
    return None


def _candidates(run: Path) -> list[Path]:
    """The checkpoint folders of ``run`` by name (a save that died between its renames left ``NAME.old``: read as
    ``NAME``, as ``checkpoint.resolve`` does); links are no checkpoint of the run."""
    names = set()
    with os.scandir(run) as entries:
        for e in entries:
            base = e.name.removesuffix(".old") if _OLD.fullmatch(e.name) else e.name
            if (base == "checkpoint" or PERIODIC.fullmatch(base)) and e.is_dir(follow_symlinks=False):
                names.add(base)
    return [run / n for n in sorted(names)]


def verify(path: Path) -> None:
    """The checkpoint at ``path`` checks out: its manifest, every tensor file's size and SHA-256, every extra file's
    SHA-256 (``CheckpointError`` naming what does not)."""
    folder, meta = read_meta(path)
    try:
        check_files(folder, meta)
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot read a file ({e.strerror or e})") from None
    for name in meta["extras"]:
        read_extra(folder, meta, name)
