"""``--save-steps N`` / ``--save-total-limit K`` / ``--resume-from-checkpoint``: a run commits a complete checkpoint
every N steps and keeps the newest K; a run killed between two saves resumes from its latest and ends bit for bit
as one that was never stopped; a damaged newest checkpoint falls back to the next; ``lazytrain export`` of a run
folder reads its newest one.  Both run kinds: the built-in task and a ``--data`` fine-tune."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lazytrain.app import saves
from lazytrain.app.cli import main

TINY = ["--batch", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu", "--time-limit-min", "0",
        "--no-eval", "--threads", "1"]
SAVES = ["--steps", "7", "--save-steps", "2", "--save-total-limit", "2"]


def _metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _curve(m: dict) -> list:
    return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in m["loss_curve"]]


def _state(ckpt) -> dict:
    """The SHA-256 of every tensor file of a checkpoint: the whole trainer state, weights and optimizer."""
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    return {name: f["sha256"] for name, f in meta["files"].items()} | {"step": meta["step"]}


def _killed_after(monkeypatch, step: int) -> None:
    """The run dies (an exception, as a kill would leave it: no final commit) after step ``step``."""
    real = saves.Saver.step

    def dying(self, s, bar=None):
        real(self, s, bar)
        if s == step:
            raise RuntimeError("simulated kill")
    monkeypatch.setattr(saves.Saver, "step", dying)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: 7 steps, a save every 2, the newest 2 kept."""
    out = tmp_path_factory.mktemp("whole")
    assert main(["train", *TINY, *SAVES, "--output", str(out)]) == 0
    return out


def test_the_newest_k_periodic_checkpoints_and_the_final_one_stay(whole):
    names = sorted(p.name for p in whole.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint", "checkpoint-4", "checkpoint-6"]
    m = _metrics(whole)
    assert [s["step"] for s in m["saves"]] == [2, 4, 6] and all(s["save_s"] >= 0 for s in m["saves"])
    inside = json.loads((whole / "checkpoint-4" / "metrics.json").read_text())    # the metrics as of step 4
    assert inside["steps_done"] == 4 and _curve(inside) == _curve(m)[:4] and inside["final_eval"] == "pending"
    assert _state(whole / "checkpoint-4")["step"] == 4 and _state(whole / "checkpoint")["step"] == 7


def test_a_killed_run_resumes_from_its_newest_checkpoint_bit_for_bit(whole, tmp_path, monkeypatch, capsys):
    out = tmp_path / "killed"
    with monkeypatch.context() as mp:
        _killed_after(mp, 5)
        assert main(["train", *TINY, *SAVES, "--output", str(out)]) == 2
    assert "simulated kill" in capsys.readouterr().err
    assert not (out / "checkpoint").exists() and sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4"]
    spare = tmp_path / "spare"
    shutil.copytree(out, spare)
    # --resume OUTPUT takes the newest complete checkpoint: step 4 of 7
    assert main(["train", "--resume", str(out), "--output", str(out), "--no-progress", "--threads", "1"]) == 0
    assert "reading checkpoint-4 (step 4)" in capsys.readouterr().out
    assert _curve(_metrics(out)) == _curve(_metrics(whole)) and _state(out / "checkpoint") == _state(whole /
                                                                                                    "checkpoint")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    # the newest damaged: resume_from_checkpoint falls back to step 2, with a line saying so, and still ends the same
    block = sorted((spare / "checkpoint-4").glob("block_*.safetensors"))[0]
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    assert main(["train", "--resume-from-checkpoint", "--output", str(spare), "--no-progress", "--threads", "1"]) == 0
    said = capsys.readouterr().out
    assert "checkpoint-4 (step 4) does not check out, falling back" in said and "reading checkpoint-2 (step 2)" in said
    assert _curve(_metrics(spare)) == _curve(_metrics(whole)) and _state(spare / "checkpoint") == _state(whole /
                                                                                                        "checkpoint")


def test_a_checkpoint_folder_named_resumes_from_it(whole, tmp_path, capsys):
    out = tmp_path / "branch"
    assert main(["train", "--resume-from-checkpoint", str(whole / "checkpoint-4"), "--output", str(out), "--steps",
                 "5", "--no-progress", "--threads", "1"]) == 0
    m = _metrics(out)
    w = _metrics(whole)           # (the same state at step 4; the schedule then anneals to step 5, not 7)
    assert m["steps_done"] == 5 and _curve(m)[:4] == _curve(w)[:4] and _curve(m)[4][1] == _curve(w)[4][1]
    assert _curve(m)[4][2] != _curve(w)[4][2]


def test_pruning_deletes_only_complete_checkpoints_of_ours(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "checkpoint.json").write_text("{}")
    (tmp_path / "checkpoint-1").mkdir()                                       # no manifest: not ours
    (tmp_path / "checkpoint-0.tmp-abcdefgh").mkdir()                          # a save in flight
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "checkpoint.json").write_text("{}")
    os.symlink(elsewhere, tmp_path / "checkpoint-3")                          # a link: never followed
    assert saves.prune(tmp_path, 1) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0.tmp-abcdefgh", "checkpoint-1", "checkpoint-3",
                                                          "checkpoint-6", "elsewhere"]
    assert (elsewhere / "checkpoint.json").is_file()
    assert saves.prune(tmp_path, 1, keep_also="checkpoint-6") == [] and saves.prune(tmp_path, 0) == ["checkpoint-6"]


def test_resume_mistakes_are_one_line_errors(whole, tmp_path, capsys):
    assert main(["train", "--resume", str(whole), "--resume-from-checkpoint", "--output", str(whole)]) == 2
    assert "both name what to resume" in capsys.readouterr().err
    assert main(["train", "--resume-from-checkpoint", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 2
    assert "neither a run folder" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(whole, broken)
    for ckpt in broken.glob("checkpoint*"):
        (ckpt / "metrics.json").write_text("{}")
    assert main(["train", "--resume", str(broken), "--output", str(broken)]) == 2
    assert "no checkpoint in it checks out" in capsys.readouterr().err


def test_a_fine_tune_saves_periodically_and_resumes_from_its_latest(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(24)])
    args = ["train", *TINY, "--eval-size", "2", "--model", str(folder), "--data", str(data), "--seq", "64", "--steps",
            "4", "--save-steps", "2"]
    whole, out = tmp_path / "whole", tmp_path / "killed"
    assert main([*args, "--output", str(whole)]) == 0
    with monkeypatch.context() as mp:
        _killed_after(mp, 3)
        assert main([*args, "--output", str(out)]) == 2
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint-2"]
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--output", str(out), "--no-progress", "--threads", "1"]) == 0
    assert "reading checkpoint-2 (step 2)" in capsys.readouterr().out
    assert _curve(_metrics(out)) == _curve(_metrics(whole)) and _state(out / "checkpoint") == _state(whole /
                                                                                                    "checkpoint")
    # lazytrain export of the run folder reads its newest checkpoint (the final one, step 4)
    assert main(["export", str(out), "-o", str(tmp_path / "exported")]) == 0
    assert "reading checkpoint (step 4)" in capsys.readouterr().out
    assert main(["export", str(out / "checkpoint-2"), "-o", str(tmp_path / "at2")]) == 0     # or the one named


def test_saving_changes_nothing_in_the_training(whole, tmp_path):
    """A save flushes the lagged host updates early; the run goes on exactly as one that never saved."""
    out = tmp_path / "plain"
    assert main(["train", *TINY, "--steps", "7", "--output", str(out)]) == 0
    assert not list(out.glob("checkpoint-*")) and _metrics(out)["saves"] == []
    assert _curve(_metrics(out)) == _curve(_metrics(whole)) and _state(out / "checkpoint") == _state(whole /
                                                                                                    "checkpoint")
