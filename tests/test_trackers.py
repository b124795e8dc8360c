"""``--report-to`` (``lazytrain/app/trackers.py``): a short run on the task model logs to TensorBoard and its event
files read back with every scalar and the evaluations' sample replies; a tracker whose library is missing is one
error before any training; W&B (offline) and MLflow (a local file store) when they are installed."""

from __future__ import annotations

import builtins
import importlib.util
import json

import pytest

from lazytrain.app.cli import main

RUN = ["train", "--batch", "4", "--eval-size", "4", "--policy", "keep-all", "--no-progress", "--device", "cpu",
       "--threads", "1", "--time-limit-min", "0", "--steps", "4", "--eval-every", "2"]
#: what every step writes (trackers.step_scalars; the GPU's memory only on a GPU)
STEP_SCALARS = {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s",
                "train/loss_tokens_per_s", "train/model_tflops", "train/step_s", "memory/host_rss_gib",
                "memory/host_peak_rss_gib"}


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("tb") / "run"
    assert main([*RUN, "--output", str(out), "--report-to", "tensorboard", "--run-name", "tiny-tb"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return out, events


def test_tensorboard_events_hold_every_scalar_of_every_step(tb_run):
    out, events = tb_run
    tags = set(events.Tags()["scalars"])
    assert STEP_SCALARS <= tags, STEP_SCALARS - tags
    assert {"eval/exact_match", "final/exact_match", "final/steps_done"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]        # --logging-steps 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert [round(e.value, 4) for e in events.Scalars("train/loss")] == \
        [round(h["loss"], 4) for h in metrics["loss_curve"]]
    # every token of the batch (4 x seq) against those with a label: the two rates differ, as do their counts
    curve = metrics["loss_curve"][0]
    assert curve["tok_s"] > curve["loss_tok_s"] > 0
    rates = [events.Scalars(f"train/{k}")[0].value for k in ("tokens_per_s", "loss_tokens_per_s")]
    assert rates[0] > rates[1] > 0
    assert [e.step for e in events.Scalars("eval/exact_match")] == [2, 4]      # --eval-every 2, then the final eval


def test_tensorboard_events_hold_the_sample_replies_and_settings(tb_run):
    _, events = tb_run
    tensors = set(events.Tags()["tensors"])
    assert {"eval/samples/text_summary", "settings/text_summary"} <= tensors, tensors
    samples = events.Tensors("eval/samples/text_summary")
    assert [e.step for e in samples] == [2, 4]
    text = samples[0].tensor_proto.string_val[0].decode()
    assert "| correct | prompt | reference | reply |" in text and "Q: " in text
    settings = events.Tensors("settings/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "tiny-tb" in settings and '"batch": 4' in settings


def test_logging_steps_writes_the_means_of_its_steps(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main([*RUN, "--no-eval", "--output", str(out), "--report-to", "tensorboard", "--logging-steps", "3"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    losses = [h["loss"] for h in json.loads((out / "metrics.json").read_text())["loss_curve"]]
    got = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(got) == [3, 4]        # every 3 steps, and what is left at the end
    assert got[3] == pytest.approx(sum(losses[:3]) / 3, rel=1e-4) and got[4] == pytest.approx(losses[3], rel=1e-4)


@pytest.mark.parametrize("name,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb"),
                                         ("mlflow", "mlflow")])
def test_a_missing_tracker_library_is_one_error_before_training(tmp_path, monkeypatch, capsys, name, module):
    real = builtins.__import__

    def no_tracker(mod, *a, **k):
        if mod == module or mod.startswith(module + "."):
            raise ModuleNotFoundError(f"No module named '{module}'")
        return real(mod, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tracker)
    monkeypatch.setattr(importlib, "import_module", lambda mod, *a: no_tracker(mod))

    out = tmp_path / "run"
    assert main([*RUN, "--output", str(out), "--report-to", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"report_to {name}: its library is not installed" in err[0], err
    package = {"mlflow": "mlflow-skinny"}.get(name, name)
    assert f"pip install {package} (lazytrain's '{name}' extra)" in err[0]
    assert not out.exists()     # refused before the run claimed its output folder (the model loads after that)


@pytest.mark.parametrize("value,error", [("all", "name the trackers"), ("tensorbord", "not a tracker"),
                                         ("none,wandb", "'none' with trackers")])
def test_report_to_values_that_are_refused(capsys, value, error):
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--report-to", value])
    assert e.value.code == 2 and error in capsys.readouterr().err


def test_report_to_none_and_lists():
    from lazytrain.app.trackers import parse
    assert parse("none") == () and parse("") == () and parse(None) == ()
    assert parse("TensorBoard, wandb,tensorboard") == ("tensorboard", "wandb")
    assert parse(["mlflow"]) == ("mlflow",)


def test_trackers_close_on_an_exception():
    """A failed run still ends each tracker's run (marked failed), and one tracker failing to close does not leave
    the others open."""
    from lazytrain.app.trackers import Trackers
    closed = []

    class Fake:
        def __init__(self, fails=False):
            self.fails = fails

        def close(self, ok=True, killed=False):
            closed.append((ok, killed))
            if self.fails:
                raise OSError("disk full")
    with pytest.raises(KeyboardInterrupt), Trackers([Fake(fails=True), Fake()]):
        raise KeyboardInterrupt
    assert closed == [(False, True), (False, True)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (the wandb extra)")
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main([*RUN, "--output", str(out), "--report-to", "wandb", "--run-name", "tiny-wandb"]) == 0
    (run,) = (out / "wandb").glob("offline-run-*")
    (records,) = run.glob("run-*.wandb")            # what `wandb sync` uploads: protobuf records
    data = records.read_bytes()
    for name in (*STEP_SCALARS, "eval/exact_match", "final/steps_done", "tiny-wandb"):
        assert name.encode() in data, name
    tables = sorted((run / "files" / "media" / "table" / "eval").glob("samples_*.table.json"))
    assert [t.name.split("_")[1] for t in tables] == ["2", "4"]
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "reference", "reply", "correct"] and len(table["data"]) == 3


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (the mlflow extra)")
def test_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    assert main([*RUN, "--output", str(out), "--report-to", "mlflow", "--run-name", "tiny-mlflow"]) == 0
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("lazytrain")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tiny-mlflow" and run.info.status == "FINISHED"
    assert STEP_SCALARS <= set(run.data.metrics) and run.data.params["batch"] == "4"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    files = [f.path for f in client.list_artifacts(run.info.run_id, "eval")]
    assert files == ["eval/step_000002.md", "eval/step_000004.md"]


def test_a_resume_logs_to_the_trackers_its_run_named(tb_run, tmp_path):
    """``report_to`` is carried: ``--resume`` without the flag adds an events file, the curves continuing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, _ = tb_run
    out = tmp_path / "resumed"
    assert main([*RUN, "--steps", "5", "--no-eval", "--resume", str(run), "--output", str(out)]) == 0
    assert json.loads((out / "metrics.json").read_text())["settings"]["report_to"] == ["tensorboard"]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [5]


def test_a_data_run_reports_its_evaluations_with_eval_loss_and_replies(tmp_path):
    """The fine-tune loop (``--data``): the eval before training (step 0), each ``--eval-every`` and the final one,
    with the eval loss and the sample replies; ``tokens_per_s`` is batch x seq, ``loss_tokens_per_s`` the labels."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("transformers")
    from ft_fixtures import chat, tiny_folder, write_jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(40)])
    out = tmp_path / "run"
    assert main(["train", *RUN[1:], "--steps", "2", "--model", str(tiny_folder(tmp_path / "hf")), "--data", str(data),
                 "--seq", "64", "--no-export", "--output", str(out), "--report-to", "tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert STEP_SCALARS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("eval/eval_loss")] == [0, 2]
    assert [e.step for e in events.Tensors("eval/samples/text_summary")] == [0, 2]
    curve = json.loads((out / "metrics.json").read_text())["loss_curve"]
    assert curve[0]["tok_s"] == pytest.approx(4 * 64 / curve[0]["step_s"], rel=0.01, abs=1)
    assert curve[0]["loss_tok_s"] == pytest.approx(curve[0]["tokens"] / curve[0]["step_s"], rel=0.01, abs=1)


def test_a_run_that_fails_mid_way_keeps_its_events(tmp_path, monkeypatch, capsys):
    """An exception in step 3 ends the run (one-line error); the tracker is closed on the way out (its run marked
    failed, TensorBoard's writer flushed, not left to its 10 s flush) and the steps before it are in the events."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lazytrain.app.trackers import TensorBoard
    from lazytrain.runtime.trainer import Trainer
    real, real_close, closed = Trainer.step, TensorBoard.close, []

    def close(self, ok=True, killed=False):
        closed.append(ok)
        real_close(self, ok, killed)
    monkeypatch.setattr(TensorBoard, "close", close)

    def failing(self, batch):
        if self.steps == 2:
            raise RuntimeError("injected failure")
        return real(self, batch)
    monkeypatch.setattr(Trainer, "step", failing)
    out = tmp_path / "run"
    assert main([*RUN, "--output", str(out), "--report-to", "tensorboard", "--no-eval"]) == 2
    assert "injected failure" in capsys.readouterr().err and closed == [False]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_a_run_stopped_by_sigterm_ends_its_tracker_run_with_the_final_metrics(tmp_path, monkeypatch):
    """SIGTERM (a scheduler's) stops after the step in flight: the run is saved and the tracker gets the steps done
    and the final metrics before it is closed."""
    import os
    import signal

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lazytrain.runtime.trainer import Trainer
    real = Trainer.step

    def term(self, batch):
        if self.steps == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, batch)
    monkeypatch.setattr(Trainer, "step", term)
    out = tmp_path / "run"
    assert main([*RUN, "--output", str(out), "--report-to", "tensorboard", "--no-eval"]) == 128 + signal.SIGTERM
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [(e.step, e.value) for e in events.Scalars("final/steps_done")] == [(2, 2.0)]


def test_only_rank_0_reports():
    from types import SimpleNamespace

    from lazytrain.app.trackers import Trackers
    cfg = SimpleNamespace(report_to=["tensorboard"], run_name=None, output="x", logging_steps=1)
    assert Trackers.open(cfg, "unused", main=False).backends == []
