"""A run owns its output folder: ``claim`` is the first thing ``lazytrain train`` does and the last it undoes.

- *One run a folder.*  ``.lazytrain.lock`` in the folder is locked (``flock``, not blocking) while the run lasts; a
  second run on the folder is refused at once.  The lock file stays: removing it would let two runs lock two files
  of the same name.
- *No silent replacing.*  A run over a folder that holds another run (a checkpoint or metrics) is refused unless it
  resumes that folder or ``--overwrite`` asks for it; ``lazytrain train`` run twice with the default ``--output``
  says so.
- *No links.*  The names a run reads or writes in its folder (``NAMES``, and the files of its ``checkpoint/`` and
  ``source/``) may not be symbolic links: a run folder may come from anyone (``--resume``), and a link would make
  the run read or replace a file outside it.  Writers rename over their names besides (``util/atomic.py``), so a
  link planted while the run runs is replaced, never followed.
- *Nothing left behind.*  Staging folders of a save that was killed (``atomic.STAGED``) are removed when the next
  run claims the folder; a run that fails before it wrote anything removes the folders it created.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..util.atomic import remove_staged
from .config import TrainConfig

LOCK = ".lazytrain.lock"
#: what a run reads or writes in its folder (train.py, runfiles.py, finetune/run.py, the --profile files)
NAMES = ("metrics.json", "loss.png", "checkpoint", "checkpoint.old", "source", "model", "profile.json", "plan.json",
         "trace.json", "memory.png", "tensorboard", "wandb", "mlruns", LOCK)
#: the folders among them whose files are read back (--resume, lazytrain export)
_READ = ("checkpoint", "checkpoint.old", "source")
#: the folders among them (the others are files)
_FOLDERS = (*_READ, "model", "tensorboard", "wandb", "mlruns")      # (the last three: --report-to, trackers.py)


@contextlib.contextmanager
def claim(cfg: TrainConfig, main: bool = True) -> Iterator[Path]:
    """``cfg.output``, created, checked and locked for the block (see the module docstring); ``main``: the process
    that locks it (rank 0 of several)."""
    out = Path(cfg.output)
    if os.path.lexists(out) and not out.is_dir():
        what = "a symbolic link to nothing" if not out.exists() else "a file of that name exists"
        raise ValueError(f"--output {out}: {what}; --output is a folder")
    created = _create(out)
    fd = None
    try:
        for folder, flag in ((out, "--output"), *([(Path(cfg.resume), "--resume")] if cfg.resume else [])):
            refuse_links(folder, flag)
        if main:
            fd = _lock(out)
            gone = remove_staged(out) + (remove_staged(out / "checkpoint") if (out / "checkpoint").is_dir() else [])
            if gone:
                print(f"removed {len(gone)} staging folder(s) a killed save left in {out}: {', '.join(gone)}")
        _refuse_replacing(out, cfg)
        yield out
    except BaseException:
        _remove_empty(created, out if fd is not None else None)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _create(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; returns those created, deepest first."""
    missing = [p for p in (out, *out.parents) if not os.path.lexists(p)]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output {out}: cannot create the folder ({e.strerror or e})") from None
    return missing


def _lock(out: Path) -> int:
    path = out / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ValueError(f"--output {out}: cannot open its lock file {LOCK} ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(f"--output {out}: another run is using this folder (it holds {LOCK}); wait for it to "
                             f"finish, or choose another --output") from None
        raise ValueError(f"--output {out}: cannot lock {LOCK} ({e.strerror or e})") from None
    return fd


def refuse_links(folder: Path, flag: str) -> None:
    """``ValueError`` when a name the run uses in ``folder``, or a file of the folders it reads back, is a symbolic
    link, or a folder where the run writes a file (or the reverse): refused before any work, not after training."""
    if not folder.is_dir():
        return
    for name in NAMES:
        path = folder / name
        links = [path] if path.is_symlink() else []
        if not links and name in _READ and path.is_dir():
            links = sorted(p for p in path.iterdir() if p.is_symlink())
        if links:
            raise ValueError(f"{flag} {folder}: {links[0]} is a symbolic link; a run reads and writes only the files "
                             f"in its own folder, never through a link (remove the link)")
        if not links and os.path.lexists(path) and path.is_dir() != (name in _FOLDERS):
            raise ValueError(f"{flag} {folder}: {path} is a {'folder' if path.is_dir() else 'file'}; the run keeps its "
                             f"{'folder' if name in _FOLDERS else 'file'} of that name there (move it)")


def _refuse_replacing(out: Path, cfg: TrainConfig) -> None:
    """A run over a folder holding another run: refused unless it resumes that folder or ``--overwrite``."""
    held = [n for n in ("checkpoint", "checkpoint.old", "metrics.json") if os.path.lexists(out / n)]
    held += sorted(p.name for p in out.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name))  # --save-steps
    if not held or cfg.overwrite or (cfg.resume and _same(Path(cfg.resume), out)):
        return
    raise ValueError(f"--output {out} holds a run ({held[0]}); this run would replace it: --resume {out} continues "
                     f"it, --overwrite replaces it, or choose another --output")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _remove_empty(created: list[Path], locked: Path | None) -> None:
    """After a failed run: the folders it created, where it wrote nothing in them (its lock file aside)."""
    if not created:
        return
    if locked is not None and [p.name for p in locked.iterdir()] == [LOCK]:
        (locked / LOCK).unlink(missing_ok=True)
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return
