"""In-step rates (``lazytrain.measure.step_rates``): read from a profiled step of a plan, written into the hardware
profile, and used by the next compile for the parameter loads, gradient offloads and host updates, and only for
them (activation copies keep the copy benchmark's rates)."""

from __future__ import annotations

import dataclasses
import json
from functools import cache

import pytest

from lazytrain.app.cli import main
from lazytrain.compiler.api import compile_model
from lazytrain.compiler.hardware import HardwareProfile
from lazytrain.compiler.profiles import get_profile
from lazytrain.ir import OpKind, Plan, Resource
from lazytrain.ir.summary import measured_blocks
from lazytrain.measure.step_rates import MIN_OPS, measure
from lazytrain.runtime.profiling import StepProfile

#: the recompute head throughout (``auto`` may take a single-pass head where its memory allows: another signature)
SHAPE = dict(batch_size=8, seq_len=64, policy="megatrain", resident="none", gpu_update="none", gpu_memory="8GiB",
             loss_head="recompute")
#: the rates the fake step below "ran" at
LOAD_GBPS, GRAD_GBPS, UPDATE_GPARAMS = 20.0, 15.0, 2.5


@cache
def _plan(hardware: str = "h200") -> Plan:
    return compile_model("tiny", hardware=hardware, **SHAPE)


def _amount(plan: Plan, op) -> tuple[str, float] | None:
    if op.kind is OpKind.LOAD and op.resource is Resource.H2D:
        return "load", op.nbytes / (LOAD_GBPS * 1e9)
    if op.kind is OpKind.GRAD_OFFLOAD:
        return "grad", op.nbytes / (GRAD_GBPS * 1e9)
    if op.kind is OpKind.UPDATE and op.resource is Resource.CPU:
        return "update", plan.graph.blocks[op.block].owned_numel / (UPDATE_GPARAMS * 1e9)
    if op.kind is OpKind.RELOAD:
        return "reload", 1.0        # an activation copy: very slow, and it must not count
    return None


def _fake_step(plan: Plan, keep=lambda op: True) -> StepProfile:
    """A profile of ``plan`` whose ops took what the rates above give, laid end to end."""
    trace, t = [], 0.0
    for op in plan.ops:
        got = _amount(plan, op)
        if got is None or not keep(op):
            continue
        trace.append((op.id, op.resource.value, t, t + got[1]))
        t += got[1]
    return StepProfile(step_s=t, hidden={}, transfer_s={}, exposed_update_s=0.0, update_s=0.0, busy_s={}, trace=trace)


def test_the_rates_are_what_the_ops_moved_over_their_seconds():
    plan = _plan()
    rates = measure(plan, _fake_step(plan))
    assert rates.param_load_gbps == pytest.approx(LOAD_GBPS)
    assert rates.grad_offload_gbps == pytest.approx(GRAD_GBPS)
    assert rates.host_update_gparams == pytest.approx(UPDATE_GPARAMS)
    assert rates.ops == {"update": 6, "load": 11, "grad_offload": 6, "forwards": 0, "backwards": 0}
    assert rates.forward_ratio is None and rates.backward_ratio is None     # no block of it measured
    assert "parameter and state loads 20.0 GB/s" in rates.describe(get_profile("h200"))


def test_the_next_compile_prices_loads_offloads_and_updates_at_them_and_nothing_else():
    hw = get_profile("h200")
    plan = _plan()
    fitted = measure(plan, _fake_step(plan)).apply(hw)
    assert (fitted.param_load_gbps, fitted.grad_offload_gbps) == pytest.approx((LOAD_GBPS, GRAD_GBPS))
    assert fitted.cpu_adam8_gparams == pytest.approx(UPDATE_GPARAMS)
    assert (fitted.h2d_gbps, fitted.d2h_gbps) == (hw.h2d_gbps, hw.d2h_gbps)
    assert "measured in a plan's step" in fitted.source
    again = compile_model("tiny", hardware=fitted, **SHAPE)
    assert [(op.kind, op.block, op.mb) for op in again.ops] == [(op.kind, op.block, op.mb) for op in plan.ops]
    seen = set()
    for op, old in zip(again.ops, plan.ops):
        if op.kind is OpKind.LOAD:
            assert op.seconds == pytest.approx(old.seconds * hw.h2d_gbps / LOAD_GBPS)
        elif op.kind is OpKind.GRAD_OFFLOAD and op.seconds:
            # the copy at the measured rate; a tied owner's offload also pays the host sum of its readers'
            # shares, priced at the host update's rate
            old_copy = op.nbytes / (hw.d2h_gbps * 1e9)
            assert op.seconds == pytest.approx(op.nbytes / (GRAD_GBPS * 1e9)
                                               + (old.seconds - old_copy) * hw.cpu_adam8_gparams / UPDATE_GPARAMS)
        elif op.kind is OpKind.UPDATE and op.resource is Resource.CPU:
            assert op.seconds == pytest.approx(old.seconds * hw.cpu_adam8_gparams / UPDATE_GPARAMS)
        elif op.kind in (OpKind.RELOAD, OpKind.OFFLOAD, OpKind.COMPUTE, OpKind.BACKWARD):
            assert op.seconds == pytest.approx(old.seconds)
        seen.add(op.kind)
    assert {OpKind.LOAD, OpKind.GRAD_OFFLOAD, OpKind.UPDATE, OpKind.RELOAD} <= seen
    assert again.predicted["step_time_s"] > plan.predicted["step_time_s"]


def test_measured_blocks_are_scaled_to_their_times_in_the_step():
    """The GPU runs a step's forwards slower than the calibration timed them (its clocks under a step's load):
    the measured blocks' forwards and backwards over their prices become the profile's in-step scales, and the
    next compile prices those blocks at the step's times (forward, recompute, backward), the rest as before."""
    from lazytrain.compiler.block_timing import BlockTiming
    base = _plan()
    sigs = {base.graph.block_signature(j): base.graph.blocks[j].name for j in range(base.graph.n_blocks)}
    timings = tuple(BlockTiming(signature=sig, block=name, micro_batch=mb, seq_len=base.seq_len,
                                forward_s=1e-3 * mb, backward_s=2e-3 * mb, recompute_s=1.1e-3 * mb, samples=3)
                    for sig, name in sigs.items() for mb in (1, 2, 4, 8))
    hw = get_profile("h200").with_timings(timings)
    plan = compile_model("tiny", hardware=hw, **SHAPE)
    assert measured_blocks(plan)
    slower = {OpKind.COMPUTE: 1.2, OpKind.RECOMPUTE: 1.2, OpKind.BACKWARD: 1.05}
    trace, t = [], 0.0
    for op in plan.ops:
        if op.kind in slower:
            trace.append((op.id, op.resource.value, t, t + op.seconds * slower[op.kind]))
            t += op.seconds * slower[op.kind]
    prof = StepProfile(step_s=t, hidden={}, transfer_s={}, exposed_update_s=0.0, update_s=0.0, busy_s={}, trace=trace)
    rates = measure(plan, prof)
    assert (rates.forward_ratio, rates.backward_ratio) == pytest.approx((1.2, 1.05))
    fitted = rates.apply(hw)
    assert (fitted.step_forward_scale, fitted.step_backward_scale) == pytest.approx((1.2, 1.05))
    assert "scaled to their times in a plan's step" in fitted.source
    assert HardwareProfile.from_json(json.loads(json.dumps(fitted.to_json()))) == fitted
    again = compile_model("tiny", hardware=fitted, **SHAPE)
    assert [(op.kind, op.block, op.mb) for op in again.ops] == [(op.kind, op.block, op.mb) for op in plan.ops]
    for op, old in zip(again.ops, plan.ops):
        assert op.seconds == pytest.approx(old.seconds * slower.get(op.kind, 1.0))
    # measured again on a step that ran as priced: the scales stay
    exact = StepProfile(step_s=t, hidden={}, transfer_s={}, exposed_update_s=0.0, update_s=0.0, busy_s={},
                        trace=[(op.id, op.resource.value, 0.0, op.seconds) for op in again.ops if op.kind in slower])
    assert measure(again, exact).apply(fitted).step_forward_scale == pytest.approx(1.2)


def test_too_few_timed_ops_give_no_rate_and_leave_the_profile_as_it_was():
    plan = _plan()
    loads = [op.id for op in plan.ops if op.kind is OpKind.LOAD][:MIN_OPS - 1]
    rates = measure(plan, _fake_step(plan, keep=lambda op: op.kind is not OpKind.LOAD or op.id in loads))
    assert rates.param_load_gbps is None and rates.grad_offload_gbps is not None
    assert rates.apply(get_profile("h200")).param_load_gbps == 0.0


def test_a_profile_of_another_plan_is_refused():
    plan = _plan()
    other = compile_model("tiny", hardware="h200", **{**SHAPE, "batch_size": 16})
    saved = StepProfile.from_json(_fake_step(plan).to_json(plan))
    with pytest.raises(ValueError, match="measured on another plan"):
        measure(other, saved)


def test_the_profile_rejects_a_negative_rate_and_keeps_the_rates_through_json():
    hw = dataclasses.replace(get_profile("h200"), param_load_gbps=30.0, grad_offload_gbps=25.0)
    assert HardwareProfile.from_json(json.loads(json.dumps(hw.to_json()))) == hw
    with pytest.raises(ValueError, match="param_load_gbps must be positive"):
        dataclasses.replace(hw, param_load_gbps=-1.0)


def test_lazytrain_profile_step_writes_the_rates_into_the_file(tmp_path, capsys):
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    _fake_step(plan).save(tmp_path / "profile.json", plan)
    get_profile("h200").save(tmp_path / "hw.json")
    assert main(["profile", "-o", str(tmp_path / "hw.json"), "--step", str(tmp_path / "plan.json"),
                 str(tmp_path / "profile.json")]) == 0
    assert "gradient offloads and state stores 15.0 GB/s" in capsys.readouterr().out
    hw = HardwareProfile.load(tmp_path / "hw.json")
    assert (hw.param_load_gbps, hw.grad_offload_gbps) == pytest.approx((LOAD_GBPS, GRAD_GBPS))
    assert main(["profile", "-o", str(tmp_path / "missing.json"), "--step", str(tmp_path / "plan.json"),
                 str(tmp_path / "profile.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_several_profiled_steps_give_each_rate_as_its_median(tmp_path, capsys):
    """One step whose host updates ran 2x slow (an outlier) among three: the median keeps the other steps' rate;
    the CLI takes several profiles the same way and refuses a PLAN without one."""
    plan = _plan()
    slow = {op.id for op in plan.ops if op.kind is OpKind.UPDATE}

    def stretched(factor: float) -> StepProfile:
        p = _fake_step(plan)
        trace = [(i, r, t0, t0 + (t1 - t0) * (factor if i in slow else 1.0)) for i, r, t0, t1 in p.trace]
        return dataclasses.replace(p, trace=trace)
    steps = [_fake_step(plan), stretched(2.0), stretched(1.1)]
    rates = measure(plan, steps)
    assert rates.host_update_gparams == pytest.approx(UPDATE_GPARAMS / 1.1)
    assert rates.param_load_gbps == pytest.approx(LOAD_GBPS)
    assert rates.ops["update"] == 3 * measure(plan, steps[0]).ops["update"]
    plan.save(tmp_path / "plan.json")
    for k, p in enumerate(steps):
        p.save(tmp_path / f"p{k}.json", plan)
    get_profile("h200").save(tmp_path / "hw.json")
    assert main(["profile", "-o", str(tmp_path / "hw.json"), "--step", str(tmp_path / "plan.json"),
                 *(str(tmp_path / f"p{k}.json") for k in range(3))]) == 0
    assert HardwareProfile.load(tmp_path / "hw.json").cpu_adam8_gparams == pytest.approx(UPDATE_GPARAMS / 1.1)
    capsys.readouterr()
    assert main(["profile", "-o", str(tmp_path / "hw.json"), "--step", str(tmp_path / "plan.json")]) == 2
    assert "at least one PROFILE" in capsys.readouterr().err


def test_a_gpu_updated_blocks_state_copies_go_at_the_model_state_rates():
    from lazytrain.compiler.cost import CostModel
    hw = dataclasses.replace(get_profile("h200"), param_load_gbps=LOAD_GBPS, grad_offload_gbps=GRAD_GBPS)
    cost = CostModel(_plan().graph, hw, 8, "bfloat16")
    n = cost.state_bytes(1)
    assert cost.state_load_s(1) == pytest.approx(n / (LOAD_GBPS * 1e9))
    assert cost.state_store_s(1) == pytest.approx(n / (GRAD_GBPS * 1e9))
    assert cost.h2d_s(n) == pytest.approx(n / (hw.h2d_gbps * 1e9))      # an activation's copy: the benchmark's
