"""Writing a file the user named, atomically: a temporary file beside it, fsync, rename.

A rename replaces whatever the name points at, so the path is checked first: a symbolic link is followed (the
file it names is replaced, the link stays, as ``cp`` does), and anything that is not a regular file -- a
folder, ``/dev/null``, a FIFO -- is refused with a ``ValueError`` naming it (run as root, renaming over
``/dev/null`` replaced the device).  The new file gets the mode the umask gives a new file (``mkstemp``'s is
0600), or the replaced file's; on any failure the temporary file is removed.

A folder (a checkpoint, an exported model) is written the same way, one level up: its files go into a temporary
folder beside it (``write_synced``, ``fsync_file``, ``fsync_dir``), and ``commit_folder`` renames that over it
(``staged_folder`` does all three for one writer).

Inside a run folder (``lazytrain train --output``, ``--resume``: a folder that may come from anyone) no name is
followed: ``staged_files`` writes files into a new private folder inside it and renames each over its name, and a
rename replaces a symbolic link at that name, never the file the link points to (``commit_folder`` likewise moves a
linked folder's link aside and deletes the link, not what it names).  Every staging folder is named
``<name>.tmp-<8 random characters>`` (``STAGED``); those a killed writer left are removed by ``remove_staged``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


def output_path(path: str | os.PathLike, what: str = "output") -> Path:
    """The regular file ``path`` names (links followed), which may not exist yet; ``ValueError`` when it names a
    folder, a device or another special file, or nothing at all."""
    if not str(path):
        raise ValueError(f"output path is empty: name a file for the {what}")
    target = Path(os.path.realpath(path))
    try:
        st = target.stat()
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ValueError(f"cannot write the {what} to {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"output path {path} is a folder: name a file in it for the {what}")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"refusing to replace {path}: not a regular file (the {what} is written by renaming a new "
                         f"file over the path)")
    return target


def write_atomic(path: str | os.PathLike, data: str | bytes, what: str = "output") -> Path:
    """Write ``data`` to ``path`` (checked by ``output_path``) so a crash leaves the old file or the new one,
    never half of one.  Returns the file written."""
    target = output_path(path, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None             # a new file: the umask's mode, as ``open`` gives it
    tmp, fd = _new_file(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def _new_file(target: Path) -> tuple[str, int]:
    """A new, empty file beside ``target`` (mode 0666 less the umask) and its descriptor."""
    while True:
        tmp = str(target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp"))
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path`` and flush it to the disk (a file in a folder ``commit_folder`` renames
    next); a name that exists, a symbolic link included, is an error (``FileExistsError``), never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    """Flush the file at ``path`` to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush the folder ``path`` (its entries: the names created or renamed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the name of a staging folder: ``<name>.tmp-`` and ``mkdtemp``'s 8 random characters (``_stage``), or ``world``
#: (``runtime/checkpoint_world.py``)
STAGED = re.compile(r".+\.tmp-(?:[a-z0-9_]{8}|world)")


def _stage(parent: Path, name: str) -> Path:
    """A new staging folder in ``parent`` (mode 0700) for the folder or file ``name``."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=parent, prefix=f"{name}.tmp-"))


def _remove(path: Path) -> None:
    """Remove ``path``: a symbolic link is unlinked (what it names is left alone), a folder removed with its files."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_staged(folder: Path) -> list[str]:
    """Remove the staging folders (``STAGED``) that killed writers left in ``folder`` (real folders only: a link
    of such a name is left, as is everything else); returns their names."""
    gone = []
    with os.scandir(folder) as entries:
        for e in entries:
            if STAGED.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
                gone.append(e.name)
    return sorted(gone)


def commit_folder(tmp: Path, target: Path) -> None:
    """Make the finished folder ``tmp`` the folder ``target`` with two renames: ``target`` to ``<target>.old``,
    then ``tmp`` to ``target``.  A crash leaves ``target`` or, between the renames, ``<target>.old`` (the next
    commit removes it); temporary folders ``<target>.tmp-*`` left by killed writers are removed.  A symbolic
    link at ``target`` or ``<target>.old`` is renamed and unlinked, never followed."""
    old = target.with_name(target.name + ".old")
    if os.path.lexists(target) and os.path.lexists(old):      # a previous save died after its second rename
        _remove(old)
    if os.path.lexists(target):
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if os.path.lexists(old):
        _remove(old)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):   # left by saves that were killed
        if STAGED.fullmatch(stale.name) and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A new temporary folder beside ``target`` for the block to fill; when the block ends without an error it is
    flushed (``fsync_dir``) and committed as ``target`` (``commit_folder``), on an error removed (``target`` as
    it was)."""
    tmp = _stage(target.parent, target.name)
    try:
        yield tmp
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_folder(tmp, target)


@contextlib.contextmanager
def staged_files(folder: Path, what: str = "files") -> Iterator[Path]:
    """A new private folder inside ``folder`` for the block to write files into by name (any writer that takes a
    path: ``savefig``, ``json``); when the block ends without an error each one is flushed and renamed to its
    name in ``folder``, replacing whatever is there -- a symbolic link is replaced, never followed.  The
    staging folder is removed in any case."""
    tmp = _stage(folder, f".{what}")
    try:
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            if (tmp / name).is_file() and not (tmp / name).is_symlink():
                fsync_file(tmp / name)
        for name in names:
            if os.path.isdir(folder / name) and not os.path.islink(folder / name):
                raise IsADirectoryError(f"cannot write {folder / name}: a folder of that name is in the way")
            os.replace(tmp / name, folder / name)
        fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_file(path: Path, data: str | bytes) -> None:
    """``path`` replaced atomically by a new regular file holding ``data``; a link at ``path`` is replaced, the file
    it names is not touched (``staged_files``)."""
    with staged_files(path.parent, path.name) as tmp:
        write_synced(tmp / path.name, data.encode() if isinstance(data, str) else data)
