"""In-step rates: the host update and the parameter and gradient copies as a plan's own step runs them.

Calibration times the model's blocks in a small timing plan (``calibrate.py``), and the copy engines and the host
optimizer alone (``lazytrain profile``).  A host-paced step runs three things at once that those measurements run
apart: the host's optimizer updates, the parameter loads of the next forward and the gradient offloads of the
backward, all reading and writing the host's memory, and each runs slower there than measured alone (the
figures: [ledger: step-rates]); activation offloads and reloads, which run beside the GPU's work rather than the
host's, do not.

``measure(plan, profile)`` reads those three rates from a profiled step of the plan (``Trainer(profile=True)``,
``StepProfile``): bytes or parameters moved over the seconds their ops took (each op timed from when its stream
or worker started it, so waiting is not counted), and ``StepRates.apply`` puts them in a hardware profile
(``param_load_gbps``, ``grad_offload_gbps``, the optimizer's ``cpu_adam*_gparams``), where the cost model prices
every later compile's loads, offloads and host updates with them.  ``lazytrain profile --step`` and
``benchmarks/run_plan.py --refit`` do it from a saved profile; the first plan's step is the measurement, the
compile after it is the prediction that uses it.  The calibration reads the same rates from its own timing steps
(``calibrate.measure``): nearer a step than the copy benchmark, not as near as the plan's own step.
"""

from __future__ import annotations

import dataclasses

from ..compiler.hardware import HardwareProfile
from ..compiler.options import Optimizer
from ..ir import OpKind, Plan, Resource
from ..ir.summary import measured_blocks

#: fewest timed ops of a kind a rate is read from: 4 (one op's span is too noisy a figure) [ledger: step-rates]
MIN_OPS = 4
#: the GPU's work on measured blocks, by the in-step scale it is priced with (``BlockTiming.scaled``)
_COMPUTE = {OpKind.COMPUTE: "forwards", OpKind.RECOMPUTE: "forwards", OpKind.BACKWARD: "backwards"}


def rate_field(optimizer: str) -> str:
    """The hardware profile's field of ``optimizer``'s host rate."""
    return "cpu_adam8_gparams" if Optimizer(optimizer).eight_bit else "cpu_adam_gparams"


def with_host_rate(hw: HardwareProfile, gparams: float, optimizer: str,
                   where: str = "a calibration step") -> HardwareProfile:
    """``hw`` with the host optimizer's rate measured in ``where``, and its source saying so."""
    note = f"{optimizer} host update rate measured in {where}"
    source = hw.source if note in hw.source else f"{hw.source}; {note}"
    return dataclasses.replace(hw, **{rate_field(optimizer): gparams}, source=source)


@dataclasses.dataclass(frozen=True)
class StepRates:
    """Rates a profiled step reached; None where it timed fewer than ``MIN_OPS`` ops of the kind.
    ``forward_ratio`` / ``backward_ratio``: measured blocks' forwards (and recomputes) / backwards over what the
    plan priced them at (``HardwareProfile.step_forward_scale``: the clocks of a GPU under a step's load)."""

    host_update_gparams: float | None
    param_load_gbps: float | None
    grad_offload_gbps: float | None
    optimizer: str
    ops: dict[str, int]
    forward_ratio: float | None = None
    backward_ratio: float | None = None

    def apply(self, hw: HardwareProfile, where: str = "a plan's step") -> HardwareProfile:
        """``hw`` with every rate this step measured, its source saying where (``where``) they come from."""
        out = hw
        if self.host_update_gparams is not None:
            out = with_host_rate(out, self.host_update_gparams, self.optimizer, where)
        copies = {k: v for k, v in (("param_load_gbps", self.param_load_gbps),
                                    ("grad_offload_gbps", self.grad_offload_gbps)) if v is not None}
        if copies:
            note = f"parameter loads and gradient offloads at rates measured in {where}"
            source = out.source if note in out.source else f"{out.source}; {note}"
            out = dataclasses.replace(out, **copies, source=source)
        scales = {k: getattr(out, k) * r for k, r in (("step_forward_scale", self.forward_ratio),
                                                      ("step_backward_scale", self.backward_ratio)) if r is not None}
        if scales:
            note = "measured blocks scaled to their times in a plan's step"
            source = out.source if note in out.source else f"{out.source}; {note}"
            out = dataclasses.replace(out, **scales, source=source)
        return out

    def describe(self, hw: HardwareProfile) -> str:
        """One line: each measured rate against the figure ``hw`` priced it at."""
        parts = []
        if self.host_update_gparams is not None:
            parts.append(f"host {self.optimizer} update {self.host_update_gparams:.2f} G params/s "
                         f"({self.ops['update']} ops; profile {getattr(hw, rate_field(self.optimizer)):.2f})")
        if self.param_load_gbps is not None:
            parts.append(f"parameter and state loads {self.param_load_gbps:.1f} GB/s ({self.ops['load']} ops; profile "
                         f"{hw.param_load_gbps or hw.h2d_gbps:.1f})")
        if self.grad_offload_gbps is not None:
            parts.append(f"gradient offloads and state stores {self.grad_offload_gbps:.1f} GB/s "
                         f"({self.ops['grad_offload']} ops; profile {hw.grad_offload_gbps or hw.d2h_gbps:.1f})")
        for name, r, field in (("forwards", self.forward_ratio, "step_forward_scale"),
                               ("backwards", self.backward_ratio, "step_backward_scale")):
            if r is not None:
                parts.append(f"measured blocks' {name} {r:.3f}x their price ({self.ops[name]} ops; scale "
                             f"{getattr(hw, field):.3f} -> {getattr(hw, field) * r:.3f})")
        return "; ".join(parts) or "no host update, parameter load or gradient offload timed in the step"


def measure(plan: Plan, profile) -> StepRates:
    """The in-step rates of ``plan`` in ``profile``: a ``StepProfile`` measured on it (``profile.check(plan)``
    raises ``ValueError`` for another plan's), or several, whose rates are each the median over the steps that
    timed it (one step is too noisy a figure to steer a compile: [ledger: step-rates]).  Only host-side ops
    count as updates: a resident or GPU-updated block's update runs on the GPU; its state loads and stores count
    with the parameter loads and gradient offloads (the same pinned host memory, priced at the same rates)."""
    if isinstance(profile, (list, tuple)):
        if not profile:
            raise ValueError("no profiled step to measure")
        steps = [_measure_one(plan, p) for p in profile]
        fields = ("host_update_gparams", "param_load_gbps", "grad_offload_gbps", "forward_ratio", "backward_ratio")
        med = {f: _median([getattr(r, f) for r in steps]) for f in fields}
        ops = {k: sum(r.ops[k] for r in steps) for k in steps[0].ops}
        return StepRates(**med, optimizer=steps[0].optimizer, ops=ops)
    return _measure_one(plan, profile)


def _median(values: list[float | None]) -> float | None:
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    n = len(got)
    return got[n // 2] if n % 2 else (got[n // 2 - 1] + got[n // 2]) / 2


def _measure_one(plan: Plan, profile) -> StepRates:
    profile.check(plan)
    by_id = {op.id: op for op in plan.ops}
    sharded = plan.world_size > 1
    moved = {"update": [0.0, 0.0], "load": [0.0, 0.0], "grad_offload": [0.0, 0.0]}
    count = dict.fromkeys(moved, 0)
    timed = set(measured_blocks(plan))
    priced = {"forwards": [0.0, 0.0], "backwards": [0.0, 0.0]}      # [measured s, priced s]
    count.update(dict.fromkeys(priced, 0))
    for i, _res, t0, t1 in profile.trace:
        op = by_id.get(i)
        if op is None or t1 <= t0:
            continue
        if op.block in timed and op.resource is Resource.GPU and op.seconds > 0 and op.kind in _COMPUTE:
            key = _COMPUTE[op.kind]
            priced[key][0] += t1 - t0
            priced[key][1] += op.seconds
            count[key] += 1
            continue
        if op.kind is OpKind.UPDATE and op.resource is Resource.CPU:
            n = plan.graph.blocks[op.block].owned_numel
            key, amount = "update", n / plan.world_size if sharded else n
        elif op.kind in (OpKind.LOAD, OpKind.STATE_LOAD) and op.resource is Resource.H2D:
            key, amount = "load", op.nbytes
        elif op.kind in (OpKind.GRAD_OFFLOAD, OpKind.STATE_STORE) and op.resource is Resource.D2H:
            key, amount = "grad_offload", op.nbytes
        else:
            continue
        if amount:
            moved[key][0] += amount
            moved[key][1] += t1 - t0
            count[key] += 1

    def rate(key: str) -> float | None:
        amount, seconds = moved[key]
        return amount / seconds / 1e9 if count[key] >= MIN_OPS and seconds > 0 else None

    def ratio(key: str) -> float | None:
        measured_s, priced_s = priced[key]
        return measured_s / priced_s if count[key] >= MIN_OPS and priced_s > 0 else None

    return StepRates(host_update_gparams=rate("update"), param_load_gbps=rate("load"),
                     grad_offload_gbps=rate("grad_offload"), optimizer=str(plan.options.get("optimizer", "hybrid8bit")),
                     ops=count, forward_ratio=ratio("forwards"), backward_ratio=ratio("backwards"))


def refit_file(hardware: str, plan_path: str, *profile_paths: str) -> str:
    """``lazytrain profile -o HW --step PLAN PROFILE [PROFILE ...]``: the in-step rates of a saved plan's profiled
    steps (``lazytrain train --profile``, ``StepProfile.save``; each rate the median over them) written into the
    hardware profile file ``hardware``; returns what was measured, against what the file had."""
    from ..ir import Plan
    from ..runtime.profiling import StepProfile
    if not profile_paths:
        raise ValueError("--step needs PLAN and at least one PROFILE")
    hw = HardwareProfile.load(hardware)
    rates = measure(Plan.load(plan_path), [StepProfile.load(p) for p in profile_paths])
    rates.apply(hw).save(hardware)
    return f"in-step rates of {', '.join(profile_paths)}: {rates.describe(hw)}"
