"""A run folder never makes ``lazytrain train`` write outside itself, and a run owns its folder (``app/runfolder.py``):
a symbolic link at a name the run uses is refused, every writer renames a new file over its name (a link planted
later is replaced, its target untouched), a second run on a locked folder and a new run over a finished one are
refused, staging folders of a killed save are removed, a run that fails first leaves no folder."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import pytest

from lazytrain.app.cli import main
from lazytrain.util import atomic

TINY = ["--batch", "4", "--eval-size", "8", "--policy", "keep-all", "--no-progress", "--device", "cpu", "--threads",
        "1", "--time-limit-min", "0", "--no-eval"]
DECOY = "decoy: must stay as it is\n"


def _train(out, *extra) -> int:
    return main(["train", *TINY, "--output", str(out), *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run folder (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("done") / "run"
    assert _train(out, "--steps", "2") == 0
    return out


def _copy(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out


def _decoys(tmp_path):
    """A file and a folder outside every run folder, with what they hold."""
    (tmp_path / "outside").mkdir()
    f = tmp_path / "outside" / "victim.txt"
    f.write_text(DECOY)
    d = tmp_path / "outside" / "folder"
    d.mkdir()
    (d / "keep.txt").write_text(DECOY)
    return f, d


def _untouched(f, d):
    assert f.read_text() == DECOY and not f.is_symlink()
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"] and (d / "keep.txt").read_text() == DECOY


@pytest.mark.parametrize("name, kind", [("metrics.json", "file"), ("loss.png", "file"), ("checkpoint", "folder"),
                                        ("profile.json", "file")])
def test_a_link_in_the_run_folder_is_refused_on_resume(finished, tmp_path, capsys, name, kind):
    """The issue's attack: ``runs/x/metrics.json`` (or ``loss.png``, or ``checkpoint/``) a link to a file outside,
    then ``--resume runs/x --output runs/x``: refused in one line, nothing written through the link."""
    f, d = _decoys(tmp_path)
    out = _copy(finished, tmp_path)
    path = out / name
    if os.path.lexists(path):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(f if kind == "file" else d)
    capsys.readouterr()
    assert _train(out, "--resume", str(out), "--steps", "3") == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    _untouched(f, d)


def test_links_planted_while_the_run_runs_are_replaced(tmp_path, monkeypatch):
    """After the start's check: links planted at every name the run writes (files, ``checkpoint/`` and
    ``checkpoint.old``) before the ``--profile`` files and before the commit are replaced by the run's files;
    the run finishes and the decoys stay."""
    from lazytrain.app import runfiles, train
    f, d = _decoys(tmp_path)
    out = tmp_path / "run"

    def plant(names):
        for name in names:
            if not os.path.lexists(out / name):
                (out / name).symlink_to(d if name.startswith("checkpoint") else f)

    real_profile, real_commit = train._report_profile, runfiles.commit
    monkeypatch.setattr(train, "_report_profile", lambda trainer, o, bar: (
        plant(["profile.json", "plan.json", "trace.json", "memory.png"]), real_profile(trainer, o, bar)))
    monkeypatch.setattr(runfiles, "commit", lambda *a, **k: (
        plant(["metrics.json", "loss.png", "checkpoint", "checkpoint.old"]), real_commit(*a, **k))[1])
    assert _train(out, "--steps", "2", "--profile", "1") == 0
    for name in ("metrics.json", "loss.png", "profile.json", "plan.json", "trace.json", "memory.png"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert (out / "checkpoint").is_dir() and not (out / "checkpoint").is_symlink()
    assert not os.path.lexists(out / "checkpoint.old")
    _untouched(f, d)


def test_hard_links_in_the_run_folder_are_replaced_not_written(finished, tmp_path):
    """A hard link is no symbolic link to refuse: every file the run writes is a new one renamed over the name, so
    the file the hard link shares stays as it was (matplotlib writing ``loss.png`` in place would truncate it)."""
    f, d = _decoys(tmp_path)
    out = _copy(finished, tmp_path)
    for name in ("metrics.json", "loss.png"):
        (out / name).unlink()
        os.link(f, out / name)
    assert _train(out, "--resume", str(out), "--steps", "3") == 0
    assert json.loads((out / "metrics.json").read_text())["steps_done"] == 3
    _untouched(f, d)


def test_a_link_in_a_new_run_folder_is_refused(tmp_path, capsys):
    f, d = _decoys(tmp_path)
    out = tmp_path / "new"
    out.mkdir()
    (out / "loss.png").symlink_to(f)
    assert _train(out, "--steps", "1") == 2
    assert "symbolic link" in capsys.readouterr().err
    _untouched(f, d)


@pytest.mark.parametrize("name, kind", [("metrics.json", "folder"), ("checkpoint", "file")])
def test_a_name_of_the_wrong_kind_is_refused_before_training(tmp_path, capsys, name, kind):
    """``metrics.json/`` a folder or ``checkpoint`` a file: refused at the start, not after the training (a rename
    over it would fail only then)."""
    out = tmp_path / "new"
    out.mkdir()
    (out / name).mkdir() if kind == "folder" else (out / name).write_text(DECOY)
    assert _train(out, "--steps", "1", "--overwrite") == 2
    cap = capsys.readouterr()
    assert "the run keeps its" in cap.err and "Traceback" not in cap.err and "model task" not in cap.out


def test_a_link_inside_the_checkpoint_is_refused_by_every_reader(finished, tmp_path, capsys):
    """A checkpoint's file replaced by a link (its metrics: then they would be read from outside): refused on
    resume and by the checkpoint's reader (``read_meta``: ``lazytrain export``, ``Trainer.load_checkpoint``)."""
    from lazytrain.runtime.checkpoint import read_meta
    from lazytrain.runtime.manifest import CheckpointError
    f, d = _decoys(tmp_path)
    out = _copy(finished, tmp_path)
    target = tmp_path / "outside" / "metrics.json"
    shutil.copy(out / "checkpoint" / "metrics.json", target)
    (out / "checkpoint" / "metrics.json").unlink()
    (out / "checkpoint" / "metrics.json").symlink_to(target)
    assert _train(out, "--resume", str(out), "--steps", "3") == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "Traceback" not in err
    with pytest.raises(CheckpointError, match="metrics.json is a symbolic link"):
        read_meta(out / "checkpoint")
    _untouched(f, d)


def test_writers_replace_a_link_never_its_target(tmp_path):
    """What every run-folder writer goes through (``replace_file``, ``staged_files``, ``commit_folder``): a link
    planted at the name after the run's start check is replaced by the new file or folder; its target stays."""
    from lazytrain.app.runfiles import plot_into, write_json
    f, d = _decoys(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.json", "loss.png", "extra.bin"):
        (run / name).symlink_to(f)
    write_json(run / "metrics.json", {"a": 1})
    plot_into(run / "loss.png", {"train loss": [(1, 2.0), (2, 1.0)]}, title="t")
    atomic.replace_file(run / "extra.bin", b"new")
    for name in ("metrics.json", "loss.png", "extra.bin"):
        assert (run / name).is_file() and not (run / name).is_symlink()
    assert json.loads((run / "metrics.json").read_text()) == {"a": 1} and (run / "extra.bin").read_bytes() == b"new"
    # a folder: the link at the name, and one at <name>.old (a save that died between its renames)
    (run / "checkpoint").symlink_to(d)
    (run / "checkpoint.old").symlink_to(d)
    with atomic.staged_folder(run / "checkpoint") as tmp:
        atomic.write_synced(tmp / "meta.json", b"{}")
    assert (run / "checkpoint").is_dir() and not (run / "checkpoint").is_symlink()
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["meta.json"]
    assert not os.path.lexists(run / "checkpoint.old")
    # a file written into a staging folder is new: a name that exists, a link included, is never written through
    (run / "link").symlink_to(f)
    with pytest.raises(FileExistsError):
        atomic.write_synced(run / "link", b"x")
    _untouched(f, d)


def test_commit_two_never_writes_into_a_linked_checkpoint(finished, tmp_path):
    """``checkpoint/`` swapped for a link to a checkpoint elsewhere between the run's two commits: the metrics'
    rewrite (``write_extra``) refuses, the other checkpoint stays as it was."""
    from lazytrain.runtime.checkpoint import write_extra
    from lazytrain.runtime.manifest import CheckpointError
    out = _copy(finished, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "checkpoint", elsewhere)
    (out / "checkpoint").symlink_to(elsewhere)
    before = (elsewhere / "metrics.json").read_bytes()
    with pytest.raises(CheckpointError, match="symbolic link"):
        write_extra(out / "checkpoint", "metrics.json", b"{}")
    assert (elsewhere / "metrics.json").read_bytes() == before


def test_a_second_run_on_a_locked_folder_is_refused(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    fd = os.open(out / ".lazytrain.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)       # another run holds the folder
        before = (out / "checkpoint" / "checkpoint.json").read_bytes()
        assert _train(out, "--resume", str(out), "--steps", "3") == 2
        err = capsys.readouterr().err
        assert f"--output {out}: another run is using this folder" in err and "Traceback" not in err
        assert (out / "checkpoint" / "checkpoint.json").read_bytes() == before
    finally:
        os.close(fd)
    assert _train(out, "--resume", str(out), "--steps", "3") == 0          # the lock released: it runs


def test_running_twice_into_the_default_folder_is_refused_without_overwrite(tmp_path, monkeypatch, capsys):
    """``lazytrain train`` twice (default ``--output runs/train``): the second says so and keeps the first run;
    ``--overwrite`` replaces it; ``--resume`` of the folder continues it."""
    monkeypatch.chdir(tmp_path)
    args = ["train", *TINY, "--steps", "1"]
    assert main(args) == 0
    first = (tmp_path / "runs/train/checkpoint/checkpoint.json").read_bytes()
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--output runs/train holds a run" in err and "--overwrite" in err and "Traceback" not in err
    assert (tmp_path / "runs/train/checkpoint/checkpoint.json").read_bytes() == first
    assert main(["train", *TINY, "--steps", "2", "--resume", "runs/train", "--output", "elsewhere"]) == 0
    assert main([*args, "--overwrite"]) == 0
    assert json.loads((tmp_path / "runs/train/metrics.json").read_text())["steps_done"] == 1
    assert (tmp_path / "runs/train/checkpoint/checkpoint.json").read_bytes() != first


def test_a_run_that_fails_first_leaves_no_folder(tmp_path, capsys):
    """A run that fails before it writes anything removes the folders it created (the task run and a --data
    run); a folder that existed stays."""
    assert _train(tmp_path / "a" / "b", "--seq", "1") == 2
    assert main(["train", *TINY, "--data", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "c")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    assert _train(tmp_path / "mine", "--seq", "1") == 2
    assert (tmp_path / "mine").is_dir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    assert _train(tmp_path / "dangling", "--steps", "1") == 2
    assert "a symbolic link to nothing" in capsys.readouterr().err and not (tmp_path / "nothing").exists()


def test_staging_folders_of_a_killed_save_are_removed_at_the_next_start(finished, tmp_path, capsys):
    """Only real folders named as ``util/atomic.py`` stages, in the run folder and its checkpoint; a link of such a
    name is not followed (its target stays), another name is kept."""
    f, d = _decoys(tmp_path)
    out = _copy(finished, tmp_path)
    stale = [out / "checkpoint.tmp-ab_12xyz", out / ".metrics.json.tmp-q1w2e3r4", out / "checkpoint" /
             ".metrics.json.tmp-zzzzzzzz"]
    for s in stale:
        s.mkdir()
        (s / "block_0000.safetensors").write_bytes(b"\0" * 1024)
    (out / "model.tmp-k3k3k3k3").symlink_to(d)
    (out / "notes.tmp-mine").mkdir()
    assert _train(out, "--resume", str(out), "--steps", "1") == 2     # fails after the start: "already at step 2"
    assert "already at step" in capsys.readouterr().err
    assert not any(os.path.lexists(s) for s in stale)
    assert (out / "model.tmp-k3k3k3k3").is_symlink() and (out / "notes.tmp-mine").is_dir()
    _untouched(f, d)


def test_a_data_run_owns_its_folder_too(tmp_path, capsys):
    """``--data`` runs: a second fresh run over the folder is refused (``--overwrite`` replaces it), a link in its
    ``source/`` (read back on resume) or at ``model/`` (the export) is refused."""
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    f, d = _decoys(tmp_path)
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(40)])
    out = tmp_path / "run"
    args = ["train", *TINY, "--model", str(folder), "--data", str(data), "--steps", "1", "--output", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2 and "holds a run" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    resume = ["train", "--resume", str(out), "--output", str(out), "--steps", "2", "--no-progress", "--device", "cpu",
              "--threads", "1", "--time-limit-min", "0"]
    for name, target in (("source/config.json", f), ("model", d)):
        kept = tmp_path / "kept"
        (out / name).rename(kept)
        (out / name).symlink_to(target)
        capsys.readouterr()
        assert main(resume) == 2
        err = capsys.readouterr().err
        assert "symbolic link" in err and name in err and "Traceback" not in err
        (out / name).unlink()
        kept.rename(out / name)
    assert main(resume) == 0
    _untouched(f, d)
