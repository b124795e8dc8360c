"""Reliability, round two (issue 22): every size bounded and checked before work starts, one-line errors
instead of tracebacks, a resume that runs no code, and the inputs that used to be accepted silently.

Checkpoint integrity and the commit point of checkpoint + metrics: ``tests/test_commit_faults.py``.
Each test here failed (a hang caught by ``within``, a traceback, or silent acceptance) before the fix.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL_GPT, small_gpt
from run_edits import write_committed_metrics
from timeouts import within

import lazytrain
from lazytrain.app.cli import main
from lazytrain.frontend.presets import build_from_config, build_model
from lazytrain.ir import PlanError
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
GPT = SMALL_GPT
TINY = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
        "--threads", "1"]


def _model(cfg=GPT):
    return small_gpt(cfg)


@pytest.fixture(scope="module")
def plan(small_plan):
    return small_plan


def _error(args, capsys, seconds: float = 20.0) -> str:
    """Run the command line; it must fail with one line (exit 2), no traceback, within ``seconds``."""
    with within(seconds):
        try:
            rc = main(args)
        except SystemExit as e:       # argparse
            rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err


# ---- hangs: sizes bounded and checked before any work ---------------------------------------------------
@pytest.mark.parametrize("size, message", [("2000", "only 1,491 distinct eval problems"),
                                           ("100000000", "more than an exact match needs")])
def test_eval_size_beyond_the_task_is_refused_at_once(size, message, capsys, tmp_path):
    assert message in _error(["train", *TINY, "--eval-size", size, "--output", str(tmp_path)], capsys, 10)
    assert not (tmp_path / "checkpoint").exists()


def test_every_distinct_eval_problem_can_be_asked_for():
    """The count is exact: asking for all of them ends (each has a wording that fits), one more is refused."""
    import dataclasses

    from lazytrain.tasks import PRESETS, check_eval_size, eval_examples
    from lazytrain.tasks.eval_size import eval_problem_count
    small = dataclasses.replace(PRESETS["tiny"], name="one-digit", max_digits=1, max_answer=18)
    n = eval_problem_count(small, 10_000)
    assert 5 <= n < 100
    with within(10):
        check_eval_size(n, small)
        assert len({e.problem.key for e in eval_examples(n, small)}) == n
    with pytest.raises(ValueError, match=f"only {n} distinct eval problems"):
        check_eval_size(n + 1, small)


@pytest.mark.parametrize("args, message", [
    (["compile", "tiny", "--batch", "10000000000000"], "at most 65,536"),
    (["compile", "tiny", "--batch", "65521", "--seq", "64"], "more than a plan may hold"),    # prime: micro-batch 1
    (["compile", "tiny", "--batch", "16384", "--seq", "64", "--micro-batch", "1"], "16,384 micro-batches x"),
    (["compile", "tiny", "--seq", "10000000"], "beyond the positions model 'tiny' handles (512)"),
    (["train", *TINY, "--batch", "100000000"], "at most 65,536"),
    (["train", *TINY, "--seq", "10000000"], "tokens a step"),
])
def test_absurd_sizes_are_refused_before_any_work(args, message, capsys, tmp_path, monkeypatch):
    def work(*a, **k):      # refused before any trace or search: these would run for minutes at such sizes
        raise AssertionError("the command started work before refusing the size")
    monkeypatch.setattr("lazytrain.compiler.pipeline.run", work)
    monkeypatch.setattr("lazytrain.frontend.trace_cache.trace_and_store", work)
    out = ["--hardware", "cpu", "-o", str(tmp_path / "p.json")] if args[0] == "compile" else ["--output", str(tmp_path)]
    err = _error([*args, *out], capsys, 60)
    assert message in err, err


def test_micro_batch_candidates_are_found_without_a_loop_to_the_batch():
    from lazytrain.frontend.validate import micro_batch_candidates
    with within(1):
        assert micro_batch_candidates(10**13, 6) == [32]         # none fits: the largest divisor up to 32
        assert micro_batch_candidates(960, 6) == [32, 30, 24, 20, 16, 15, 12, 10, 8, 6, 5, 4, 3, 2, 1]
        assert micro_batch_candidates(4096, 6) == [32, 16, 8, 4]       # 4096 micro-batches x 6 blocks: too long
        assert micro_batch_candidates(65521, 6) == [1]                 # a prime: micro-batch 1


def test_a_sequence_beyond_the_model_positions_is_refused_at_compile_and_by_the_trainer(plan):
    with pytest.raises(ValueError, match=r"seq_len 1,024 is beyond the positions model 'tiny' handles \(512\)"):
        lazytrain.compile("tiny", batch_size=8, seq_len=1024, hardware="cpu")
    short = _model({**GPT, "max_seq": 8})         # same parameters but the position table: 8 rows
    with pytest.raises(ValueError, match="beyond the positions the model handles"):
        lazytrain.compile(short, batch_size=4, seq_len=16, hardware="cpu")
    with pytest.raises(ValueError, match="beyond the positions"):
        Trainer(short, plan, device="cpu")


def test_a_long_sequence_is_traced_in_constant_time():
    """The chunked loss on meta tensors is one chunk (FLOPs are linear in the rows), not seq / 2048."""
    from lazytrain.frontend.trace import trace
    rope = build_from_config({**GPT, "rope": True, "max_seq": 1 << 24}, device="meta")
    with within(30):
        long = trace(rope, seq_len=10_000_000, dtype="float32")
    short = trace(rope, seq_len=10_000, dtype="float32")
    head_long, head_short = long.blocks[-1], short.blocks[-1]
    assert head_long.fwd_flops == pytest.approx(head_short.fwd_flops * 1000, rel=1e-6)


def test_compile_without_seq_fits_the_model():
    from lazytrain.app.cli import build_parser
    a = build_parser().parse_args(["compile", "tiny"])
    assert a.seq is None      # cmd_compile takes min(1024, the model's positions): 512 for tiny


# ---- tracebacks -> one-line errors ---------------------------------------------------------------------
QWEN = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "max_position_embeddings": 64}


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "nosuch"}, "cannot build the qwen2 model: KeyError"),
    ({"model_type": ["qwen2"]}, "model_type must be a string"),
    ({"rope_theta": -1}, "rope_theta must be positive"),
    ({"rope_theta": "big"}, "rope_theta must be a finite number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be positive"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"attention_dropout": 1.5}, "attention_dropout is a probability"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers 1,000,000,000 is larger than LazyTrain builds"),
    ({"max_position_embeddings": 10**30}, "max_position_embeddings .* is larger than LazyTrain builds"),
])
def test_bad_hf_config_fields_are_one_line_errors(change, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN, **change}))
    with pytest.raises(ValueError, match=message) as e:
        build_model(str(path))
    assert str(path) in str(e.value)
    assert message.split()[0] in _error(["compile", str(path), "--seq", "16", "--hardware", "cpu", "-o",
                                         str(tmp_path / "p.json")], capsys)


@pytest.mark.parametrize("change, message", [({"rope": "yes"}, "rope must be true or false"),
                                             ({"rope": True, "rope_theta": -1.0}, "rope_theta must be positive"),
                                             ({"tie_weights": 1}, "tie_weights must be true or false")])
def test_bad_gpt_config_fields(change, message):
    with pytest.raises(ValueError, match=message):
        build_from_config({**GPT, **change})


def test_config_that_is_not_utf8_names_the_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff\xfe"}')
    assert f"{path}: not a text file" in _error(["compile", str(path), "--hardware", "cpu", "-o", str(tmp_path / "p")],
                                                capsys)


def test_empty_or_unreadable_batches(plan):
    tr = Trainer(_model(), plan, optimizer=TorchAdamW(lr=1e-3), device="cpu", verbose=False)
    empty = [(torch.zeros(0, 16, dtype=torch.long),) * 2, (torch.zeros(4, 0, dtype=torch.long),) * 2]
    for batch in [*empty, ("abc", "abc"), ([[1, 2], [3]], [[1, 2], [3]])]:
        with pytest.raises(ValueError, match="is empty|must be a \\[batch, seq\\] tensor"):
            tr.step(batch)
    assert tr.step((torch.zeros(4, 16, dtype=torch.long),) * 2).tokens > 0     # still usable


@pytest.mark.parametrize("bad, message", [(None, "Trainer needs a Plan, got NoneType"),
                                          ({}, "got dict: Plan.from_json"), ("plan.json", "got str")])
def test_trainer_without_a_plan(bad, message):
    with pytest.raises(TypeError, match=message):
        Trainer(_model(), bad, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device, message", [("cuda", "no CUDA GPU is visible"), ("tpu", "is not a device")])
def test_trainer_on_a_device_that_is_not_there(plan, device, message):
    with pytest.raises(ValueError, match=message):
        Trainer(_model(), plan, device=device)


def test_seed_past_64_bits_is_a_usage_error(capsys):
    assert "must be below 2**63" in _error(["train", "--seed", "99999999999999999999999"], capsys)


def test_plan_with_a_5000_digit_integer(plan, tmp_path):
    text = json.dumps(plan.to_json()).replace('"batch_size": 4', '"batch_size": ' + "9" * 5000, 1)
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(PlanError, match="not a LazyTrain plan"):
        lazytrain.Plan.load(tmp_path / "plan.json")


def test_plan_with_an_absurd_sequence_is_refused(plan):
    d = plan.to_json()
    d["seq_len"] = d["graph"]["seq_len"] = 2**61
    with pytest.raises(PlanError, match="seq_len out of range"):
        lazytrain.Plan.from_json(d)


# ---- accepted silently before ---------------------------------------------------------------------------
def test_nvme_dir_that_climbs_out_is_refused_at_compile(capsys, tmp_path):
    out = tmp_path / "p.json"
    err = _error(["compile", "tiny", "--seq", "64", "--hardware", "cpu", "--nvme-dir", "/x/../etc",
                  "--nvme-memory", "1GiB", "-o", str(out)], capsys)
    assert "climbs out with '..'" in err and not out.exists()


def test_more_threads_than_cores_is_refused(capsys, tmp_path):
    err = _error(["train", *TINY, "--threads", "1000", "--output", str(tmp_path)], capsys)
    assert "more threads than cores only wait" in err


# ---- security: resume runs no code ------------------------------------------------------------------------
class Killed(BaseException):
    """The process dying (nothing after it runs, no handler catches it)."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A fresh run killed during its final eval (the training is committed; the eval is not)."""
    import lazytrain.app.train as train

    def killed(*a, **k):
        raise Killed
    out = tmp_path_factory.mktemp("run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "evaluate", killed)
        with pytest.raises(Killed):
            main(["train", *TINY, "--steps", "2", "--output", str(out)])
    return out


def test_a_run_killed_during_its_final_eval_resumes(run_dir, tmp_path):
    m = json.loads((run_dir / "checkpoint" / "metrics.json").read_text())
    assert m["steps_done"] == 2 and m["final_eval"] == "pending" and m["exact_match"] is None
    assert main(["train", *TINY, "--steps", "2", "--resume", str(run_dir), "--output", str(tmp_path / "o")]) == 0
    r = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert r["steps_done"] == 2 and r["final_eval"] == "done" and r["loss_curve"] == m["loss_curve"]
    assert r == json.loads((tmp_path / "o" / "checkpoint" / "metrics.json").read_text())


def test_ctrl_c_during_the_final_eval_stops_it_at_once(monkeypatch):
    import os
    import signal

    import lazytrain.app.train as train

    def slow_eval(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    monkeypatch.setattr(train, "evaluate", slow_eval)
    from lazytrain.app.session import StopFlag
    # Ctrl-C as in a terminal: a runner started in the background ignores SIGINT, and StopFlag leaves an ignored
    # signal ignored (as it leaves nohup's SIGHUP)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopFlag() as flag, within(8):     # (the eval sleeps 10 s unless Ctrl-C stops it)
            assert train._final_eval(None, [], torch.device("cpu"), flag) is None
    finally:
        signal.signal(signal.SIGINT, previous)


def _edit_metrics(run: Path, edit, digest: bool = True) -> None:
    """Edit the copy committed with the checkpoint (``digest``: and its SHA-256 in the manifest)."""
    m = json.loads((run / "checkpoint" / "metrics.json").read_text())
    edit(m)
    write_committed_metrics(run, json.dumps(m), digest=digest)


def test_resume_never_imports_a_factory_unless_allowed(run_dir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "factory_ran"
    (tmp_path / "evil_factory.py").write_text(f"def build():\n    open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _edit_metrics(run, lambda m: m.update(model={"spec": "evil_factory:build"}))
    err = _error(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o")], capsys)
    assert "--allow-factory" in err and not marker.exists() and "evil_factory" not in sys.modules
    main(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o"), "--allow-factory"])
    assert marker.exists()          # the flag is what lets it run
    capsys.readouterr()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("model"), "field model is missing"),
    (lambda m: m.pop("loss_curve"), "field loss_curve is missing"),
    (lambda m: m["settings"].update(batch="32"), "settings.batch must be a whole number"),
    (lambda m: m.update(model="qwen2.5-7b"), "field model must be"),
    (lambda m: m.update(steps_done=1), "do not belong together"),
    (lambda m: m["loss_curve"].pop(), "do not belong together"),
])
def test_edited_metrics_are_one_line_errors(run_dir, tmp_path, capsys, edit, message):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    _edit_metrics(run, edit)
    assert message in _error(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o")],
                             capsys)


@pytest.mark.parametrize("edit", [
    lambda m: m.update(final_loss=16.05),
    lambda m: m["loss_curve"][0].update(loss=float("nan")),
    lambda m: m["loss_curve"][1].update(loss=m["loss_curve"][1]["loss"] * 2),
])
def test_metrics_edited_behind_the_checkpoints_back_are_refused(run_dir, tmp_path, capsys, edit):
    """The metrics committed with a checkpoint are checked against the SHA-256 its manifest records (as its
    tensor files are): an edited final loss or a NaN put into the curve does not come back in the resumed
    run's metrics."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    _edit_metrics(run, edit, digest=False)
    err = _error(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o")], capsys)
    assert "metrics.json: sha256" in err and "the file is corrupted (or was edited)" in err


def test_committed_metrics_that_are_not_a_file_are_refused_unread(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "checkpoint" / "metrics.json").unlink()
    os.mkfifo(run / "checkpoint" / "metrics.json")
    err = _error(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o")], capsys)
    assert "metrics.json: not a regular file" in err


def test_a_loss_that_is_not_finite_is_written_as_null_and_resumed(run_dir, tmp_path, monkeypatch):
    """A diverged loss (NaN, infinity) is kept, written as JSON's null (never a bare NaN that strict readers
    refuse), and a resume reads it back as NaN."""
    import lazytrain.app.runfiles as runfiles
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    m = json.loads((run / "checkpoint" / "metrics.json").read_text())
    m["loss_curve"][0].update(loss=float("nan"), grad_norm=float("inf"))
    runfiles.write_json(tmp_path / "m.json", m)
    strict = json.loads((tmp_path / "m.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert strict["loss_curve"][0]["loss"] is None and strict["loss_curve"][0]["grad_norm"] is None
    write_committed_metrics(run, (tmp_path / "m.json").read_text())
    from lazytrain.app.config import TrainConfig
    _cfg, prev = runfiles.load_resume(TrainConfig(resume=str(run), steps=3))
    assert math.isnan(prev["loss_curve"][0]["loss"]) and math.isnan(prev["loss_curve"][0]["grad_norm"])
    assert main(["train", *TINY, "--steps", "3", "--resume", str(run), "--output", str(tmp_path / "o"),
                 "--no-eval"]) == 0
    out = (tmp_path / "o" / "checkpoint" / "metrics.json").read_text()
    assert "NaN" not in out and json.loads(out)["loss_curve"][0]["loss"] is None


def test_the_factory_form_is_documented_as_running_code():
    from lazytrain.app.cli import build_parser
    readme, errors = (ROOT / "README.md").read_text(), (ROOT / "docs" / "errors.md").read_text()
    assert "--allow-factory" in readme and "--allow-factory" in errors
    assert "calls the factory: it runs code" in readme
    helps = build_parser()._subparsers._group_actions[0].choices
    assert "runs code" in helps["compile"].format_help().replace("\n", " ").replace("  ", " ")


def test_a_data_run_with_a_loss_that_was_not_finite_resumes(tmp_path):
    """A ``--data`` run's metrics keep a diverged loss as null; its resume reads it back as NaN (the loss plot and
    the curve go on), and writes it as null again."""
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "d.jsonl", [chat(f"{i}+1", f"{i + 1}") for i in range(8)])
    args = ["--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
            "--threads", "1", "--time-limit-min", "0", "--no-eval", "--no-export"]
    out = tmp_path / "o"
    assert main(["train", *args, "--model", str(folder), "--data", str(data), "--steps", "2", "--output",
                 str(out)]) == 0
    for path in (out / "metrics.json", out / "checkpoint" / "metrics.json"):   # as a NaN loss is written
        m = json.loads(path.read_text())
        m["loss_curve"][0]["loss"] = None
        if path.parent.name == "checkpoint":     # (the resume reads the copy committed with the checkpoint)
            write_committed_metrics(out, json.dumps(m))
        else:
            path.write_text(json.dumps(m))
    assert main(["train", *args, "--resume", str(out), "--output", str(out), "--steps", "3"]) == 0
    text = (out / "metrics.json").read_text()
    curve = json.loads(text)["loss_curve"]
    assert "NaN" not in text and curve[0]["loss"] is None and len(curve) == 3
