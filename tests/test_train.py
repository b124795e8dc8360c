"""``lazytrain train`` end to end with tiny settings: trains, evaluates, writes metrics and a checkpoint;
``--resume`` continues from that checkpoint; bad flags give one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from run_edits import write_committed_metrics

from lazytrain.app.cli import main
from lazytrain.app.config import TrainConfig
from lazytrain.app.loop import lr_at

TINY = ["--batch", "4", "--eval-size", "8", "--policy", "keep-all", "--no-progress", "--device", "cpu"]


def _train(out, *extra) -> dict:
    assert main(["train", *TINY, "--output", str(out), *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, _train(out, "--steps", "3", "--lr", "0.01")


def test_train_writes_metrics_and_checkpoint(first_run):
    out, m = first_run
    assert m["format"] == "lazytrain.train-metrics/1"
    assert m["steps_done"] == 3 and len(m["loss_curve"]) == 3 and m["stop_reason"] == "steps"
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in m["loss_curve"])
    assert 0.0 <= m["exact_match"] <= 1.0 and m["eval_size"] == 8
    assert m["settings"]["difficulty"] == TrainConfig().difficulty == "tiny-pad-carry" and m["settings"]["batch"] == 4
    assert m["model"]["config"]["vocab"] == 98 and m["device"] == "cpu" and m["param_dtype"] == "float32"
    assert (out / "checkpoint" / "checkpoint.json").is_file()
    assert not list(out.glob("*.tmp*"))


def test_no_eval_skips_the_exact_match_of_the_task(tmp_path, capsys):
    """``--no-eval`` on the built-in task (not only with ``--data``): no eval during or after the run."""
    m = _train(tmp_path, "--steps", "2", "--eval-every", "1", "--no-eval")
    assert m["final_eval"] == "skipped (--no-eval)" and m["exact_match"] is None and m["steps_done"] == 2
    assert "exact match" not in capsys.readouterr().out


def test_profile_prints_overlap_and_writes_the_measured_step(tmp_path, capsys):
    from lazytrain.runtime.profiling import StepProfile
    _train(tmp_path, "--steps", "3", "--profile", "2")
    out = capsys.readouterr().out
    assert "hidden under compute" in out and "grad_offload" in out and "update (host)" in out
    prof = StepProfile.load(tmp_path / "profile.json")
    assert prof.trace and json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "loss.png").stat().st_size > 0
    # the pair the run wrote is what `lazytrain profile --step` reads into a hardware profile
    from lazytrain.compiler.hardware import HardwareProfile
    from lazytrain.compiler.profiles import get_profile
    get_profile("cpu").save(tmp_path / "hw.json")
    assert main(["profile", "-o", str(tmp_path / "hw.json"), "--step", str(tmp_path / "plan.json"),
                 str(tmp_path / "profile.json")]) == 0
    assert "in-step rates" in capsys.readouterr().out
    assert "measured in a plan's step" in HardwareProfile.load(tmp_path / "hw.json").source


def test_without_matplotlib_training_finishes_without_pictures(tmp_path, monkeypatch):
    import lazytrain.app.train as train
    import lazytrain.compiler.timeline as timeline

    def no_pyplot():       # what timeline._pyplot raises when matplotlib is not installed
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib (lazytrain's 'plot' extra)")
    monkeypatch.setattr(timeline, "_pyplot", no_pyplot)
    monkeypatch.setattr(train, "can_plot", lambda: False)
    m = _train(tmp_path, "--steps", "2", "--profile", "2")
    assert m["steps_done"] == 2 and (tmp_path / "profile.json").exists() and (tmp_path / "trace.json").exists()
    assert not list(tmp_path.glob("*.png"))


def test_resume_continues_from_the_checkpoint(first_run, tmp_path):
    out, m = first_run
    out2 = tmp_path / "resumed"
    r = _train(out2, "--resume", str(out), "--steps", "5")
    assert r["steps_done"] == 5 and r["resumed_from"] == str(out)
    assert [h["step"] for h in r["loss_curve"]] == [1, 2, 3, 4, 5]
    assert r["loss_curve"][:3] == m["loss_curve"]
    ckpt = json.loads((out2 / "checkpoint" / "checkpoint.json").read_text())
    assert ckpt["step"] == 5


def test_an_answer_format_trains_records_its_name_and_resumes(tmp_path):
    """``--difficulty tiny-rev-pad``: trained on and evaluated in that format, recorded by its canonical
    name (what a resume compares), and resumed from its checkpoint."""
    from lazytrain.tasks import get_difficulty
    out = tmp_path / "rev"
    m = _train(out, "--steps", "2", "--difficulty", "tiny-rev-pad")
    assert m["settings"]["difficulty"] == "tiny-pad-rev" and m["steps_done"] == 2
    assert m["settings"]["seq"] == get_difficulty("tiny-pad-rev").seq_len != get_difficulty("tiny").seq_len
    r = _train(tmp_path / "resumed", "--resume", str(out), "--steps", "3", "--difficulty", "tiny-pad-rev")
    assert r["steps_done"] == 3 and r["settings"]["difficulty"] == "tiny-pad-rev"
    assert r["loss_curve"][:2] == m["loss_curve"]
    assert main(["train", *TINY, "--output", str(tmp_path / "x"), "--resume", str(out), "--steps", "4",
                 "--difficulty", "tiny-pad-lsb"]) == 2


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """3 steps + resume to 5 replays the data stream and restores the optimizer, so with a constant
    learning rate its losses are those of 5 steps in one go."""
    from lazytrain.app.train import run
    common = dict(batch=4, eval_size=4, policy="keep-all", progress=False, device="cpu", warmup=1, min_lr_ratio=1.0,
                  time_limit_min=None)
    straight = run(TrainConfig(steps=5, output=str(tmp_path / "straight"), **common))
    run(TrainConfig(steps=3, output=str(tmp_path / "first"), **common))
    resumed = run(TrainConfig(steps=5, output=str(tmp_path / "resumed"), resume=str(tmp_path / "first"), **common))
    assert [h["loss"] for h in resumed["loss_curve"]] == pytest.approx([h["loss"] for h in straight["loss_curve"]],
                                                                       rel=1e-5)
    assert resumed["loss_curve"][3]["loss"] != straight["loss_curve"][0]["loss"]


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "must be positive"),
    (["--batch", "zero"], "positive whole number"),
    (["--difficulty", "impossible"], "invalid choice"),
    (["--difficulty", "tiny-upside"], "unknown answer format 'upside'"),
    (["--gpu-memory", "lots"], ""),
    (["--batch", "0"], "must be positive"),
    (["--steps", "-1"], "must be positive"),
    (["--lr", "inf"], "finite"),
    (["--warmup", "-1"], ">= 0"),
    (["--eval-every", "-5"], ">= 0"),
    (["--time-limit-min", "soon"], "no limit"),
    (["--policy", "nope"], "invalid choice"),
])
def test_bad_flags_are_one_line_errors(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", "--output", str(tmp_path), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("lazytrain train: error: argument"), err


def test_time_limit_zero_means_no_limit():
    from lazytrain.app.cli import build_parser
    assert build_parser().parse_args(["train", "--time-limit-min", "0"]).time_limit_min is None
    assert build_parser().parse_args(["train", "--time-limit-min", "2.5"]).time_limit_min == 2.5


@pytest.mark.parametrize("args, message", [
    (["--seq", "20"], "shorter than the longest"),
    (["--model", "no-such-model"], "unknown model"),
    (["--resume", "/nonexistent/run"], "expected an output folder"),
    (["--profile", "0"], "counts from 1"),
])
def test_bad_settings_are_clear_errors(args, message, capsys, tmp_path):
    assert main(["train", *TINY, "--output", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("output", ["file", "file/sub"])
def test_output_that_cannot_be_a_folder(output, capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert main(["train", *TINY, "--steps", "1", "--output", str(tmp_path / output)]) == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / output}" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--steps", "2"], "already at step 3"),
    (["--steps", "5", "--batch", "8"], "--batch 8 differs from the run's batch (4)"),
    (["--steps", "5", "--batch", "32"], "--batch 32 differs from the run's batch (4)"),      # 32: the default
    (["--steps", "5", "--difficulty", "easy"], "--difficulty easy differs"),
    (["--steps", "5", "--answer-only-loss"], "--answer-only-loss differs"),
    (["--steps", "5", "--policy", "megatrain"], "--policy megatrain differs"),
])
def test_resume_refuses_settings_it_would_ignore(first_run, args, message, capsys, tmp_path):
    out, _ = first_run
    rc = main(["train", *TINY, "--output", str(tmp_path / "o"), "--resume", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_resume_without_the_flags_keeps_the_runs_settings(first_run, tmp_path):
    out, _ = first_run
    assert main(["train", "--no-progress", "--device", "cpu", "--eval-size", "4", "--steps", "4",
                 "--output", str(tmp_path / "o"), "--resume", str(out)]) == 0
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["settings"]["batch"] == 4 and m["settings"]["policy"] == "keep-all" and m["steps_done"] == 4


@pytest.mark.parametrize("flags, lr, said", [([], 0.01, None), (["--lr", "0.003"], 0.003, "lr 0.01 -> 0.003")])
def test_resume_keeps_the_runs_lr_unless_a_flag_changes_it_and_says_so(first_run, flags, lr, said, capsys, tmp_path):
    """Without --lr the run's 0.01, not the default; --lr given (even at the default 0.003) changes it, said."""
    out, _ = first_run
    r = _train(tmp_path / "o", "--resume", str(out), "--steps", "4", "--no-eval", *flags)
    printed = capsys.readouterr().out
    assert r["settings"]["lr"] == lr and r["settings"]["steps"] == 4
    changes = next(line for line in printed.splitlines() if "changed on this command line" in line)
    assert "steps 3 -> 4" in changes and "evaluate True -> False" in changes
    assert (said in changes) if said else " lr " not in changes, changes


@pytest.mark.parametrize("metrics", ["{", '{"format": "x"}', '{"settings": {}}'])
def test_resume_of_unreadable_metrics_is_a_clear_error(first_run, metrics, capsys, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(first_run[0], run)
    write_committed_metrics(run, metrics)     # the metrics committed with the checkpoint, and their sha256
    assert main(["train", *TINY, "--output", str(tmp_path / "o"), "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "is not the metrics of a `lazytrain train` run" in err and "Traceback" not in err


def test_lr_schedule_warms_up_then_anneals():
    cfg = TrainConfig(lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 101) == pytest.approx(0.1)
    assert lr_at(cfg, 9, 101) == pytest.approx(1.0)           # the warm-up ends at the peak ...
    assert lr_at(cfg, 10, 101) == pytest.approx(1.0)          # ... before any decay starts
    assert lr_at(cfg, 55, 101) == pytest.approx(0.55)
    assert lr_at(cfg, 100, 101) == pytest.approx(0.1)
    assert lr_at(cfg, 200, 101) == pytest.approx(0.1)
    rates = [lr_at(cfg, s, 101) for s in range(101)]
    assert all(a <= b for a, b in zip(rates[:10], rates[1:11])) and all(a >= b for a, b in zip(rates[10:], rates[11:]))


@pytest.mark.parametrize("kind,mid", [("linear", 0.55), ("constant_with_warmup", 1.0), ("constant", 1.0)])
def test_lr_schedule_kinds(kind, mid):
    cfg = TrainConfig(lr=1.0, warmup=10, min_lr_ratio=0.1, lr_scheduler_type=kind)
    assert lr_at(cfg, 55, 101) == pytest.approx(mid)
    assert lr_at(cfg, 0, 101) == pytest.approx(1.0 if kind == "constant" else 0.1)


def test_warmup_is_at_most_half_the_run_and_ratio_scales_with_it():
    from lazytrain.app.loop import warmup_steps
    assert warmup_steps(TrainConfig(warmup=50), 12) == 6          # a short run still decays
    assert warmup_steps(TrainConfig(warmup=50, warmup_ratio=0.1), 300) == 30
    cfg = TrainConfig(lr=1.0, warmup=50)
    assert lr_at(cfg, 5, 12) == pytest.approx(1.0)                # the peak is reached


def test_step_budget_follows_the_measured_pace():
    """Under a time limit the run's steps are the time left over the pace: the slow first step is left out, the
    larger of the recent and overall pace counts, and it never exceeds --steps."""
    from lazytrain.app.loop import StepBudget
    b = StepBudget(1000, limit_s=100.0)
    assert b.total(0, 0.0) == 1000                # nothing measured yet
    b.step_done(30.0)                             # the first step (slow): left out
    assert b.total(1, 30.0) == 1000
    for k in range(1, 4):
        b.step_done(30.0 + k)
    assert b.total(4, 33.0) == 1000               # too few steps timed to tell the pace
    for k in range(4, 11):
        b.step_done(30.0 + k)                     # then 1 s a step
    assert b.total(11, 40.0) == 11 + 60
    for k in range(1, 17):
        b.step_done(40.0 + 2 * k)                 # slower: 2 s a step, seen within the window
    assert b.total(27, 72.0) == 27 + 14
    assert b.total(27, 200.0) == 28               # past the limit: the step in flight is the last
    assert StepBudget(50, limit_s=1e9).total(0, 0.0) == 50


def test_ctrl_c_stops_after_the_step_and_saves(tmp_path):
    """SIGINT once: the step in flight finishes, checkpoint and metrics are written (marked
    interrupted), nothing half-written is left behind, and the exit status is 130 (128 + SIGINT: stopped, saved)."""
    import os
    import signal
    import subprocess
    import sys
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "lazytrain.app.cli", "train", *TINY, "--steps", "100000",
                          "--time-limit-min", "3", "--eval-every", "1", "--output", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []     # (the child's SIGINT at its default: a runner started in the background ignores it, and so would
    #              the child, whose Python then installs no Ctrl-C handler)
    while not (seen and seen[-1].startswith("step 1:")):     # step 1's eval line: a step is done (not a sleep)
        seen.append(p.stdout.readline())
        if not seen[-1] or len(seen) > 20:
            p.kill()
            pytest.fail("no 'step 1: ...' line:\n" + "".join(seen) + p.communicate()[0])
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.SIGINT, rest
    m = json.loads((out / "metrics.json").read_text())
    assert m["stopped_by"] == "SIGINT" and m["interrupted"] and m["stop_reason"] == "interrupted"
    assert m["exact_match"] is None
    assert 1 <= m["steps_done"] < 100000
    ckpt = json.loads((out / "checkpoint" / "checkpoint.json").read_text())
    assert ckpt["step"] == m["steps_done"]
    assert not list(out.glob("*.tmp*"))


def test_rope_scores_depend_only_on_the_offset():
    """Rotary positions: q_i . k_j is a function of i - j, and the rotation keeps norms."""
    from lazytrain.models.gpt import rotate
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    qs, ks = rotate(q.expand(1, 1, 12, 16), 10000.0), rotate(k.expand(1, 1, 12, 16), 10000.0)
    assert torch.allclose(qs.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 12), atol=1e-5)
    assert torch.allclose((qs[0, 0, 7] * ks[0, 0, 4]).sum(), (qs[0, 0, 3] * ks[0, 0, 0]).sum(), atol=1e-4)
