"""Calibration on the real blocks, in CPU mode: the model's own block programs are timed in the runtime,
written into the hardware profile, and used by the cost model for every block of that structure."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import lazytrain
from lazytrain.compiler.block_timing import BlockTiming
from lazytrain.compiler.hardware import HardwareProfile
from lazytrain.compiler.profiles import PROFILES
from lazytrain.ir import OpKind
from lazytrain.ir.summary import measured_blocks

pytest.importorskip("transformers")

# six alike layers: the timing model keeps three (first, second, last), whose code serves all six
CONFIG = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
          "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 97, "max_position_embeddings": 128}
OPTIONS = dict(batch_size=4, seq_len=32, gpu_memory="2GiB", host_memory="4GiB", param_dtype="float32",
               optimizer="adamw", policy="megatrain")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from lazytrain.frontend.presets import build_from_config
    path = tmp_path_factory.mktemp("hw") / "hw.json"
    PROFILES["cpu"].save(path)
    model = build_from_config(CONFIG, device="cpu", dtype=torch.float32)
    plan = lazytrain.compile(model, hardware=str(path), calibrate=True, **OPTIONS)
    return model, plan, path


def test_every_block_is_timed_and_the_plan_uses_the_times(calibrated):
    _, plan, _ = calibrated
    timings = [BlockTiming.from_json(t) for t in plan.hardware["calibration"]]
    assert {t.block.split(" ")[1] for t in timings} == {"(embed)", "(layer)", "(head)"}   # one per structure
    layer = next(t for t in timings if "(layer)" in t.block)
    assert layer.samples == 3 * 2 * 3          # three layers x two micro-batches x three steps
    assert layer.micro_batch == plan.micro_batch and layer.seq_len == 32
    assert measured_blocks(plan) == list(range(plan.graph.n_blocks))
    by_sig = {t.signature: t for t in timings}
    field = {OpKind.COMPUTE: "forward_s", OpKind.BACKWARD: "backward_s", OpKind.RECOMPUTE: "recompute_s"}
    seen = set()
    for op in plan.ops:
        if op.kind in field:
            t = by_sig[plan.graph.block_signature(op.block)]
            assert op.seconds == pytest.approx(getattr(t, field[op.kind]))
            seen.add(op.kind)
    assert seen == set(field)
    assert "measured on CPU (no GPU) for 8 of 8 blocks" in plan.summary().replace("\n", " ").replace("  ", " ")
    assert all(t.workspace_bytes > 0 and t.backward_workspace_bytes > 0 for t in timings)   # transients measured too


def test_the_host_update_rate_is_measured_in_the_timing_steps_and_priced(calibrated):
    """The host optimizer's rate is the one its updates reached in the timing steps (beside the copies and the
    compute), not the profile's standalone figure: the plan's update ops are priced at it."""
    _, plan, path = calibrated
    rate = plan.hardware["cpu_adam_gparams"]
    assert rate != PROFILES["cpu"].cpu_adam_gparams and "adamw host update rate measured in a calibration step" in \
        plan.hardware["source"]
    assert HardwareProfile.load(path).cpu_adam_gparams == rate           # written back with the block times
    host = [op for op in plan.ops if op.kind is OpKind.UPDATE and op.seconds > 0]
    assert host and all(op.seconds == pytest.approx(plan.graph.blocks[op.block].owned_numel / (rate * 1e9))
                        for op in host)


def test_the_timing_steps_copy_rates_are_priced_on_a_gpu_only():
    """The calibration reads the loads' and offloads' rates from its timing steps (``step_rates``) and prices them
    where those steps ran on a GPU; a CPU's copies are memcpys, so there only the host update's rate is taken."""
    from lazytrain.measure.calibrate import Measured
    from lazytrain.measure.step_rates import StepRates

    rates = StepRates(host_update_gparams=0.7, param_load_gbps=41.0, grad_offload_gbps=27.5, optimizer="adamw",
                      ops={"update": 8, "load": 8, "grad_offload": 8, "forwards": 0, "backwards": 0})
    hw = PROFILES["h200"]
    gpu, cpu = Measured([], rates).priced(hw, copies=True), Measured([], rates).priced(hw, copies=False)
    assert (gpu.param_load_gbps, gpu.grad_offload_gbps, gpu.cpu_adam_gparams) == (41.0, 27.5, 0.7)
    assert "rates measured in a calibration step" in gpu.source
    assert (cpu.param_load_gbps, cpu.grad_offload_gbps, cpu.cpu_adam_gparams) == (hw.param_load_gbps,
                                                                                   hw.grad_offload_gbps, 0.7)
    assert Measured([]).priced(hw, copies=True) == hw.with_timings([])


def test_a_gpu_timing_step_runs_its_forwards_long_enough_to_load_the_clocks(monkeypatch):
    """On a GPU the timing plan takes as many micro-batches as its forwards need to run ``SUSTAIN_S`` as modelled
    (the clocks a training step runs at), within ``MAX_MICRO``; on the CPU two."""
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.measure import calibrate

    model = build_from_config(CONFIG, device="cpu", dtype=torch.float32)
    shape = dict(micro_batch=2, seq_len=32, gpu_memory="2GiB", host_memory="4GiB", resident="none",
                 param_dtype="float32", optimizer="adamw")
    cpu = calibrate.timing_plan(model, hardware=PROFILES["cpu"], **shape)
    assert cpu.batch_size // cpu.micro_batch == calibrate.N_MICRO
    gpu = calibrate.timing_plan(model, hardware=PROFILES["h200"], **shape)
    assert gpu.batch_size // gpu.micro_batch == calibrate.MAX_MICRO      # a tiny model's forwards: microseconds
    forward = sum(op.seconds for op in gpu.ops if op.kind is OpKind.COMPUTE) / calibrate.MAX_MICRO
    monkeypatch.setattr(calibrate, "SUSTAIN_S", 5.5 * forward)
    assert calibrate.sustained(gpu, PROFILES["h200"]) == calibrate.MAX_MICRO    # never fewer than the plan's own
    six = calibrate.timing_plan(model, hardware=PROFILES["h200"], **shape)
    assert six.batch_size // six.micro_batch == 6 and six.decisions.policy == "recompute-all"


def test_a_measured_transient_above_the_traced_one_raises_the_plan_memory(calibrated):
    """A block seen to need more than its traced workspace (a GPU kernel's, an fp32 norm's backward) is charged
    the measured figure: in the graph's meta (not its signature, which names the timings), in the peak."""
    from lazytrain.ir import Plan
    from lazytrain.ir.semantics import Sizes
    _, plan, path = calibrated
    hw = HardwareProfile.load(path)
    j = next(j for j, b in enumerate(plan.graph.blocks) if b.kind == "layer")
    sig = plan.graph.block_signature(j)
    mb = plan.micro_batch
    traced = Sizes.of_plan(plan).workspace(j)
    more = [dataclasses.replace(t, workspace_bytes=traced + 64 * 2**20, backward_workspace_bytes=0)
            for t in hw.calibration if t.signature == sig]
    again = lazytrain.compile(plan.graph, hardware=hw.with_timings(more), micro_batch=mb, **OPTIONS)
    assert again.graph.meta["measured_workspace"][j] >= (traced + 64 * 2**20) // mb
    assert Sizes.of_plan(again).workspace(j) >= traced + 64 * 2**20
    assert again.graph.block_signature(j) == sig and measured_blocks(again) == list(range(again.graph.n_blocks))
    assert again.predicted["peak_gpu_bytes"] >= plan.predicted["peak_gpu_bytes"] + 60 * 2**20
    assert Plan.from_json(json.loads(json.dumps(again.to_json()))).graph.meta["measured_workspace"][j] \
        == again.graph.meta["measured_workspace"][j]


def test_the_profile_file_keeps_the_times_for_the_next_compile(calibrated, capsys):
    _, plan, path = calibrated
    hw = HardwareProfile.load(path)
    assert len(hw.calibration) == 3 and HardwareProfile.from_json(json.loads(json.dumps(hw.to_json()))) == hw
    again = lazytrain.compile(plan.graph, hardware=str(path), micro_batch=plan.micro_batch, **OPTIONS)
    assert measured_blocks(again) == list(range(again.graph.n_blocks))
    assert again.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])
    # `lazytrain profile --model` into an existing file finds the times there and measures nothing again
    from lazytrain.app.cli import main
    cfg = path.parent / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    assert main(["profile", "--model", str(cfg), "--seq", "32", "--batch", "4", "--micro-batch",
                 str(plan.micro_batch), "--gpu-memory", "2GiB", "-o", str(path)]) == 0
    out = capsys.readouterr()
    assert "measured on CPU (no GPU) for 8 of 8 blocks" in out.out.replace("\n", " ").replace("  ", " ")
    assert "[lazytrain calibrate] timing" not in out.err and len(HardwareProfile.load(path).calibration) == 3


def test_modelled_plans_say_so_and_get_a_hint_on_a_gpu(calibrated, monkeypatch, capsys):
    graph = calibrated[1].graph
    plan = lazytrain.compile(graph, hardware="cpu", **OPTIONS)
    assert measured_blocks(plan) == [] and "modelled from FLOPs" in plan.summary()
    assert capsys.readouterr().err == ""                      # no GPU here: no hint
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lazytrain.compile(graph, hardware="h200", **{**OPTIONS, "gpu_memory": "24GiB", "host_memory": "64GiB"})
    hint = capsys.readouterr().err.strip().splitlines()
    assert len(hint) == 1 and "lazytrain profile --model MODEL --seq 32" in hint[0] and "calibrate=True" in hint[0]


def test_calibration_refuses_a_profile_of_another_device_and_a_traced_graph(calibrated):
    model, plan, _ = calibrated
    with pytest.raises(ValueError, match="^calibrate=True times the blocks on this machine's cpu"):
        lazytrain.compile(model, hardware="h200", calibrate=True, **OPTIONS)
    with pytest.raises(ValueError, match="^calibrate=True needs the model"):
        lazytrain.compile(plan.graph, hardware="cpu", calibrate=True, **OPTIONS)


def test_block_timings_round_trip_and_bad_ones_are_refused():
    t = BlockTiming(signature="abc", block="layer", micro_batch=2, seq_len=64, forward_s=1e-3, backward_s=2e-3,
                    recompute_s=1e-3, samples=6)
    hw = PROFILES["h200"].with_timings([t])
    assert hw.measured("abc", 2) == t and hw.measured("abc", 4) is None
    assert HardwareProfile.from_json(json.loads(json.dumps(hw.to_json()))) == hw
    assert hw.with_timings([dataclasses.replace(t, forward_s=2e-3)]).measured("abc", 2).forward_s == 2e-3
    older = {k: v for k, v in dataclasses.asdict(t).items() if "workspace" not in k}   # a profile written before
    assert BlockTiming.from_json(older) == t
    with pytest.raises(ValueError, match="workspace_bytes must be a whole number"):
        BlockTiming.from_json({**older, "workspace_bytes": -1})
    bad = {**dataclasses.asdict(t), "forward_s": -1}
    with pytest.raises(ValueError, match="forward_s must be a positive number"):
        HardwareProfile.from_json({**hw.to_json(), "calibration": [bad]})
    with pytest.raises(ValueError, match="calibration must be a list"):
        HardwareProfile.from_json({**hw.to_json(), "calibration": {"a": 1}})


def test_the_timing_plan_falls_back_to_one_micro_batch_where_two_do_not_fit(monkeypatch):
    """At a ``--seq max`` length two micro-batches' boundaries overflow the budget the user's own plan
    (one micro-batch) fits: the timing plan steps down instead of failing the calibration (H200, 3B, 299k)."""
    from lazytrain.compiler.api import BudgetError
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.measure import calibrate

    real, asked = calibrate.compile_model, []

    def only_one_micro_batch(model, *, policy, batch_size, micro_batch, **shape):
        asked.append((policy, batch_size // micro_batch))
        if batch_size > micro_batch:
            raise BudgetError(f"batch {batch_size} does not fit")
        return real(model, policy=policy, batch_size=batch_size, micro_batch=micro_batch, **shape)

    monkeypatch.setattr(calibrate, "compile_model", only_one_micro_batch)
    model = build_from_config(CONFIG, device="cpu", dtype=torch.float32)
    plan = calibrate.timing_plan(model, micro_batch=2, seq_len=32, hardware=PROFILES["cpu"], gpu_memory="2GiB",
                                 host_memory="4GiB", resident="none", param_dtype="float32", optimizer="adamw")
    assert asked == [("recompute-all", 2), ("milp", 2), ("recompute-all", 1)]
    assert (plan.batch_size, plan.micro_batch, plan.decisions.policy) == (2, 2, "recompute-all")


def test_a_block_timed_at_another_micro_batch_is_scaled_from_the_nearest_one():
    """A block timed only at other micro-batches is priced from the nearest one (by ratio; the larger on a tie),
    scaled by the FLOP model's ratio between the two micro-batches; one timed at this micro-batch as timed; one
    never timed from its FLOPs."""
    from lazytrain.compiler.cost import CostModel
    from lazytrain.frontend.presets import build_from_config
    from lazytrain.frontend.trace import trace

    graph = trace(build_from_config(CONFIG, device="meta", dtype=torch.float32), seq_len=32, dtype="float32")
    layer, head = 1, graph.n_blocks - 1
    sig = graph.block_signature(layer)

    def timing(mb, scale):
        return BlockTiming(signature=sig, block="layer", micro_batch=mb, seq_len=32, forward_s=scale * 1e-3,
                           backward_s=scale * 3e-3, recompute_s=scale * 1.2e-3, samples=3)

    hw = PROFILES["h200"].with_timings([timing(2, 1.0), timing(8, 5.0)])
    plain = CostModel(graph, PROFILES["h200"], 4)
    at = {mb: CostModel(graph, hw, mb) for mb in (1, 2, 4, 16)}
    assert at[2].fwd_s(layer) == pytest.approx(1e-3) and at[2].bwd_s(layer) == pytest.approx(3e-3)
    for mb, base, scale in ((1, 2, 1.0), (4, 8, 5.0), (16, 8, 5.0)):     # 4 is as near 2 as 8: the larger
        f0, b0 = plain._modelled(layer, base)
        f1, b1 = plain._modelled(layer, mb)
        assert at[mb].fwd_s(layer) == pytest.approx(scale * 1e-3 * f1 / f0)
        assert at[mb].recompute_s(layer) == pytest.approx(scale * 1.2e-3 * f1 / f0)
        assert at[mb].bwd_s(layer) == pytest.approx(scale * 3e-3 * b1 / b0)
    assert at[4].fwd_s(head) == plain.fwd_s(head) and at[4].bwd_s(head) == plain.bwd_s(head)   # never timed
    plan = lazytrain.compile(graph, hardware=hw, **{**OPTIONS, "batch_size": 8, "micro_batch": 4})
    from lazytrain.ir.summary import scaled_blocks
    assert layer in scaled_blocks(plan) and head not in scaled_blocks(plan) and measured_blocks(plan) == []
    text = plan.summary().replace("\n", " ")
    assert "scaled from their timing at another micro-batch" in " ".join(text.split())
    assert "the rest modelled from FLOPs" in " ".join(text.split())
