"""A measured step as a Perfetto trace and a memory plot: a tiny GPT trained in CPU mode with profiling
(its second step, under ``runtime.memtrack`` for the device-memory curve), then ``measured_trace``,
``lazytrain trace --measured`` and the errors for a profile that is not this plan's; ``plot_loss``."""

from __future__ import annotations

import json

import pytest
import torch

import lazytrain
from lazytrain.app.cli import main
from lazytrain.compiler import timeline
from lazytrain.frontend.presets import build_from_config
from lazytrain.ir import verify
from lazytrain.runtime.memtrack import track
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.profiling import StepProfile
from lazytrain.runtime.trainer import Trainer

pytest.importorskip("matplotlib")

B, SEQ = 4, 16
GPT = {"model_type": "lazytrain-gpt", "vocab": 61, "d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 48,
       "max_seq": 32, "tie_weights": True}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_from_config(GPT, device="cpu", dtype=torch.float32)


def _compile(model, policy: str, mb: int, nvme_dir) -> lazytrain.Plan:
    return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=mb, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy=policy, nvme_dir=str(nvme_dir), gpu_memory="8GiB",
                             host_memory="16GiB", nvme_memory="1GiB")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(plan, profile of its second step, saved plan path, saved profile path)."""
    d = tmp_path_factory.mktemp("measured")
    model = _model()
    plan = _compile(model, "megatrain", 2, d)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-3), device="cpu", profile=True)
    ids = torch.randint(0, GPT["vocab"], (B, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        tr.step((ids, ids))                 # the first step has no lagged updates to apply
        with track(tr):
            tr.step((ids, ids))
    finally:
        tr.close()
    prof = tr.last_profile
    plan.save(d / "plan.json")
    prof.save(d / "profile.json", plan)
    return plan, prof, d / "plan.json", d / "profile.json"


def _x_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_measured_trace_has_every_timed_op_once_on_its_lane(measured):
    plan, prof, _, _ = measured
    trace = timeline.measured_trace(plan, prof)
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert set(lanes.values()) == set(timeline.LANES)
    xs = _x_events(trace)
    timed = sorted(op.id for op in plan.ops if op.resource.value != "none")
    assert sorted(e["args"]["op"] for e in xs) == timed          # every op with a resource, exactly once
    for e in xs:
        op = plan.ops[e["args"]["op"]]
        assert lanes[e["tid"]] == op.resource.value
        assert e["name"] == " ".join(str(op).split()) and e["dur"] >= 0
    assert {lanes[e["tid"]] for e in xs} >= {"gpu", "h2d", "d2h", "cpu"}
    assert trace["otherData"]["timeline"] == "measured" and trace["otherData"]["step_s"] == prof.step_s
    counter = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert len(counter) == len(prof.memory) > 0


def test_measured_memory_curve_is_close_to_the_prediction(measured):
    plan, prof, _, _ = measured
    assert len(prof.memory) == len(plan.ops)                      # memtrack samples after every handler
    times = [t for t, _ in prof.memory]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= prof.step_s
    peak = max(n for _, n in prof.memory)
    # the samples are what is live after each op; verify's curve is the same figure, its peak adds transients
    assert 0.5 * max(verify(plan).gpu_curve) <= peak <= 1.1 * plan.predicted["peak_gpu_bytes"]


def test_profile_json_round_trip(measured):
    plan, prof, _, path = measured
    back = StepProfile.load(path)
    assert back.trace == prof.trace and back.memory == prof.memory and back.hidden == prof.hidden
    assert back.plan["n_ops"] == len(plan.ops)
    back.check(plan)


def test_cli_writes_measured_trace_and_both_memory_curves(measured, tmp_path, monkeypatch, capsys):
    plan, prof, plan_path, prof_path = measured
    drawn = {}
    real = timeline.plot_memory

    def spy(path, curves, **kw):
        drawn.update(curves=curves, **kw)
        real(path, curves, **kw)
    monkeypatch.setattr(timeline, "plot_memory", spy)
    t, png = tmp_path / "trace.json", tmp_path / "memory.png"
    assert main(["trace", str(plan_path), "--measured", str(prof_path), "-o", str(t), "--plot", str(png)]) == 0
    trace = json.loads(t.read_text())
    assert trace["traceEvents"][0]["args"]["name"] == "lazytrain measured"
    assert len(_x_events(trace)) == len(prof.trace)
    assert set(drawn["curves"]) == {"predicted", "measured"} and drawn["curves"]["measured"] == prof.memory
    assert drawn["budget"] == plan.budgets["gpu_bytes"]
    assert png.stat().st_size > 1000
    assert "wrote" in capsys.readouterr().out


def _cli_error(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_cli_refuses_a_profile_of_another_plan(measured, tmp_path, capsys):
    _, prof, _, prof_path = measured
    other = _compile(_model(), "keep-all", 2, tmp_path)
    other_path = tmp_path / "other.json"
    other.save(other_path)
    out = ["-o", str(tmp_path / "t.json")]
    assert "measured on another plan" in _cli_error(["trace", str(other_path), "--measured", str(prof_path), *out],
                                                    capsys)
    bare = tmp_path / "bare.json"                 # no plan digest saved: the op ids and resources are checked
    bare.write_text(json.dumps(prof.to_json()))
    assert "does not fit this plan" in _cli_error(["trace", str(other_path), "--measured", str(bare), *out], capsys)
    assert "cannot read profile" in _cli_error(["trace", str(other_path), "--measured", str(tmp_path / "no.json"),
                                                *out], capsys)
    assert "not a lazytrain step profile" in _cli_error(["trace", str(other_path), "--measured", str(other_path),
                                                         *out], capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert "not valid JSON" in _cli_error(["trace", str(other_path), "--measured", str(bad), *out], capsys)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("spread, log", [(1.5, False), (100.0, True)])
def test_plot_loss_writes_a_png(tmp_path, monkeypatch, spread, log):
    from matplotlib.axes import Axes
    scales = []
    real = Axes.set_yscale
    monkeypatch.setattr(Axes, "set_yscale", lambda ax, v, **kw: (scales.append(v), real(ax, v, **kw)))
    steps = range(1, 41)
    curves = {"lazytrain": [(s, spread ** (1 - s / 40) + 1e-3) for s in steps],
              "PyTorch": [(s, spread ** (1 - s / 40)) for s in steps]}
    png = tmp_path / "loss.png"
    timeline.plot_loss(png, curves, title="tiny GPT")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert ("log" in scales) == log
