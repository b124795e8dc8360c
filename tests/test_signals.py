"""Signals, kills and a full disk keep the work (issue 42).

- SIGTERM (a scheduler's: SLURM, Kubernetes, a preemptible VM) and SIGHUP stop ``lazytrain train`` after the step
  in flight and save, as Ctrl-C does, for the built-in task and a ``--data`` run, fresh and resumed; the exit status
  is 128 + the signal's number; a second signal stops at once.
- A ``--data`` run commits its checkpoint and its metrics together: killed between its checkpoint and its metrics,
  or between its checkpoint and its final eval and export, it resumes with a loss curve of every step.
- A full disk during a checkpoint or metrics write is one line naming the folder and the space needed, and what
  was committed before stays.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lazytrain.app import runfiles
from lazytrain.app.cli import main
from lazytrain.app.session import StopFlag
from lazytrain.runtime.checkpoint import read_extra, read_meta

TASK = ["--batch", "4", "--eval-size", "8", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1"]
DATA = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1", "--no-export"]


class Killed(BaseException):
    """The process dying where it is (no ``except Exception`` catches it, as none survives a SIGKILL)."""


def _committed(out: Path) -> dict:
    """The metrics committed with the checkpoint, checked against it: the steps the checkpoint holds, a loss
    curve of every one of them."""
    folder, meta = read_meta(out / "checkpoint")
    m = json.loads(read_extra(folder, meta, runfiles.METRICS))
    assert m["steps_done"] == meta["step"]
    assert [h["step"] for h in m["loss_curve"]] == list(range(1, meta["step"] + 1))
    assert not list(out.glob("*.tmp*")), list(out.iterdir())
    return m


def _not_ignored() -> None:
    """The run's signals at their defaults (a test runner under ``nohup`` ignores SIGHUP, and so would its child)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def unhandled():
    """SIGTERM and SIGHUP fail the test unless a ``StopFlag`` takes them (and never kill the test runner)."""
    def fail(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the handler outside the StopFlag")
    prev = {sig: signal.signal(sig, fail) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield fail
    for sig, handler in prev.items():
        signal.signal(sig, handler)


def _stop_after_first_step(args: list[str], sig: signal.Signals) -> tuple[int, str]:
    """``python -m lazytrain train ARGS`` sent ``sig`` once its first step is reported (``--eval-every 1``: a line
    ``step N: ...``, N > 0); (exit status, its output).  (``--time-limit-min``: a run that ignored it still ends.)"""
    p = subprocess.Popen([sys.executable, "-m", "lazytrain", "train", *args, "--eval-every", "1",
                          "--time-limit-min", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_not_ignored)
    seen = []
    try:
        while not seen or not re.match(r"step [1-9]\d*:", seen[-1]):
            seen.append(p.stdout.readline())
            if not seen[-1]:
                pytest.fail("the run ended before its first step:\n" + "".join(seen))
        p.send_signal(sig)
        rest = p.communicate(timeout=300)[0]
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, "".join(seen) + rest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_stops_the_built_in_task_after_the_step_and_saves(tmp_path, sig):
    out = tmp_path / "run"
    code, text = _stop_after_first_step([*TASK, "--steps", "100000", "--output", str(out)], sig)
    assert code == 128 + sig, text
    assert f"stopped by {sig.name} after step" in text and "Traceback" not in text
    m = _committed(out)
    assert m["interrupted"] and m["stopped_by"] == sig.name and 1 <= m["steps_done"] < 100000
    assert json.loads((out / "metrics.json").read_text())["steps_done"] == m["steps_done"]
    if sig != signal.SIGTERM:
        return
    # resumed, stopped again, and resumed to the end: every step on the curve once
    done = m["steps_done"]
    code, text = _stop_after_first_step([*TASK, "--resume", str(out), "--output", str(out), "--steps", "100000"],
                                        sig)
    assert code == 128 + sig, text
    r = _committed(out)
    assert r["steps_done"] > done and r["loss_curve"][:done] == m["loss_curve"]
    assert main(["train", *TASK, "--no-eval", "--resume", str(out), "--output", str(out),
                 "--steps", str(r["steps_done"] + 1)]) == 0
    assert _committed(out)["loss_curve"][:r["steps_done"]] == r["loss_curve"]


def test_a_signal_stops_a_data_run_after_the_step_and_saves(tmp_path):
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+1=?", f"{i + 1}") for i in range(40)])
    out = tmp_path / "run"
    code, text = _stop_after_first_step([*DATA, "--model", str(folder), "--data", str(data), "--steps", "100000",
                                         "--output", str(out)], signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, text
    m = _committed(out)
    assert m["interrupted"] and m["stopped_by"] == "SIGTERM" and m["exact_match"] is None
    assert not list(out.glob("checkpoint.tmp-*"))
    assert main(["train", *DATA, "--resume", str(out), "--output", str(out), "--steps", str(m["steps_done"] + 1),
                 "--no-eval"]) == 0
    r = _committed(out)
    assert r["steps_done"] == m["steps_done"] + 1 and r["loss_curve"][:m["steps_done"]] == m["loss_curve"]


def test_a_second_signal_stops_at_once(unhandled):
    with StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.set and flag.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGHUP)
    assert signal.getsignal(signal.SIGTERM) is unhandled
    with StopFlag() as flag:        # the final eval (the state committed): the first one stops it at once
        flag.immediate = True
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGHUP)
        assert flag.signal == signal.SIGHUP


def test_an_ignored_signal_stays_ignored(unhandled):
    """Under ``nohup`` SIGHUP is ignored: closing the terminal must not stop the run."""
    prev = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopFlag() as flag:
            os.kill(os.getpid(), signal.SIGHUP)
            assert not flag.set
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, prev)


@pytest.mark.parametrize("where", ["lazytrain.app.runfiles.write_json",        # between checkpoint and its copy
                                   "lazytrain.app.finetune.run._export"])      # between commit 1 and commit 2
def test_a_data_run_killed_between_checkpoint_and_metrics_resumes_every_step(tmp_path, monkeypatch, where):
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+1=?", f"{i + 1}") for i in range(40)])
    out = tmp_path / "run"
    args = [a for a in DATA if a != "--no-export"] + ["--no-eval", "--output", str(out)]

    def killed(*a, **k):
        raise Killed(where)
    for steps, resume in ((2, []), (4, ["--resume", str(out)])):     # a fresh run, then a resumed one
        with monkeypatch.context() as mp:
            module, name = where.rsplit(".", 1)
            mp.setattr(importlib.import_module(module), name, killed)
            with pytest.raises(Killed):
                main(["train", *args, "--model", str(folder), "--data", str(data), "--steps", str(steps), *resume])
        assert _committed(out)["steps_done"] == steps
    assert main(["train", *args, "--resume", str(out), "--steps", "5"]) == 0
    m = _committed(out)
    assert [h["step"] for h in json.loads((out / "metrics.json").read_text())["loss_curve"]] == [1, 2, 3, 4, 5]
    assert m["final_eval"] == "skipped (--no-eval)" and m["export"]


def _full_disk_in_tensors(mp):
    """safetensors' writer on a full disk (its message, from a 1 MiB tmpfs)."""
    from safetensors import SafetensorError

    from lazytrain.runtime import checkpoint
    real, calls = checkpoint.save_file, []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 1:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real(tensors, path, metadata=metadata)
    mp.setattr(checkpoint, "save_file", save_file)


def _full_disk_in_the_metrics(mp):
    """The metrics committed with the checkpoint find no room."""
    from lazytrain.runtime import checkpoint
    real = checkpoint.write_synced

    def write_synced(path, data):
        if Path(path).name == runfiles.METRICS:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)
    mp.setattr(checkpoint, "write_synced", write_synced)


def _full_disk_in_the_copy(mp):
    """The folder's metrics.json (staged, then renamed over its name) finds no room: writing its new file fails."""
    from lazytrain.util import atomic
    real = atomic.write_synced

    def write_synced(path, data):
        if Path(path).name == runfiles.METRICS and atomic.STAGED.match(Path(path).parent.name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)
    mp.setattr(atomic, "write_synced", write_synced)


@pytest.mark.parametrize("fault", [_full_disk_in_tensors, _full_disk_in_the_metrics, _full_disk_in_the_copy])
def test_a_full_disk_is_one_line_and_keeps_the_committed_state(tmp_path, monkeypatch, capsys, fault):
    out = tmp_path / "run"
    assert main(["train", *TASK, "--no-eval", "--steps", "2", "--output", str(out)]) == 0
    before = _committed(out)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        fault(mp)
        assert main(["train", *TASK, "--no-eval", "--resume", str(out), "--output", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "error" in line]
    assert len(said) == 1 and "Traceback" not in err and "[Errno" not in err, err
    assert said[0].startswith(f"lazytrain train: error: no space left on the disk of {out} to write ") and \
        " it needs " in said[0], err
    after = _committed(out)     # the previous state, or (the checkpoint committed before its copy) the new one
    assert after["steps_done"] == (3 if fault is _full_disk_in_the_copy else 2)
    assert after["loss_curve"][:2] == before["loss_curve"]
    assert not [f for f in out.rglob("*") if ".tmp" in f.name]
    assert main(["train", *TASK, "--no-eval", "--resume", str(out), "--output", str(out), "--steps", "4"]) == 0
    assert _committed(out)["steps_done"] == 4


def test_a_signal_during_the_export_stops_it_with_the_state_committed(tmp_path, monkeypatch, unhandled):
    """After commit 1 (the final eval, the export: minutes for a large model) the first signal stops at once."""
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl

    finetune = importlib.import_module("lazytrain.app.finetune.run")
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+1=?", f"{i + 1}") for i in range(40)])
    out = tmp_path / "run"

    def export(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the export went on after SIGTERM")
    monkeypatch.setattr(finetune, "_export", export)
    args = [a for a in DATA if a != "--no-export"]
    assert main(["train", *args, "--no-eval", "--model", str(folder), "--data", str(data), "--steps", "2",
                 "--output", str(out)]) == 128 + signal.SIGTERM
    m = _committed(out)
    assert m["steps_done"] == 2 and m["stopped_by"] == "SIGTERM" and m["interrupted"] and m["export"] is None
    assert json.loads((out / "metrics.json").read_text()) == m
