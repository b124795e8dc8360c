"""Files the user names are written by renaming a new file over the path: what is at the path is checked first."""

import os
import stat

import pytest

from lazytrain.app.cli import main
from lazytrain.util.atomic import output_path, write_atomic


def test_a_link_is_followed_and_the_replaced_file_keeps_its_mode(tmp_path):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    real.chmod(0o640)
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_new_file_gets_the_umasks_mode_and_its_folders(tmp_path):
    old = os.umask(0o027)
    try:
        out = write_atomic(tmp_path / "a" / "b" / "plan.json", b"{}")
    finally:
        os.umask(old)
    assert out.read_bytes() == b"{}" and stat.S_IMODE(out.stat().st_mode) == 0o640


@pytest.mark.parametrize("kind, message", [("folder", "is a folder"), ("fifo", "not a regular file"),
                                           ("empty", "output path is empty")])
def test_what_a_rename_would_destroy_is_refused(tmp_path, kind, message):
    path = {"folder": tmp_path, "fifo": tmp_path / "fifo", "empty": ""}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ValueError, match=message):
        write_atomic(path, "x", what="plan")
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(path).st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_device_is_never_replaced():
    with pytest.raises(ValueError, match="not a regular file"):
        output_path(os.devnull)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text("old")

    def broken(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_atomic(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_compile_refuses_a_bad_output_before_tracing(tmp_path, capsys, monkeypatch):
    import lazytrain.compiler.api as api

    def no_compile(*a, **k):
        raise AssertionError("compiled before checking the output path")
    monkeypatch.setattr(api, "compile_model", no_compile)
    assert main(["compile", "qwen2.5-7b", "--gpu-memory", "24GiB", "-o", str(tmp_path)]) != 0
    assert "is a folder" in capsys.readouterr().err
