"""``seq_len="max"``: the longest sequence whose plan fits, with the budget that binds named.

The search traces the model at every length it probes; here the trace is a synthetic chain whose
per-sample bytes grow with the length as a model's do (so each probe costs milliseconds, not an export),
and the answer is checked against the definition: it fits, one resolution step more does not.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

import lazytrain
from lazytrain.compiler import seq_search
from lazytrain.compiler.api import BudgetError
from lazytrain.compiler.synthetic import chain

OPTIONS = dict(batch_size=2, hardware="h200", host_memory="64GiB", optimizer="adamw")


class _Model(nn.Module):
    """Stands for a model: the (patched) trace never looks inside."""

    def __init__(self, max_pos: int = 4096, rope_scaling: dict | None = None):
        super().__init__()
        self.config = type("Config", (), {"max_position_embeddings": max_pos, "rope_scaling": rope_scaling})()


YARN = {"rope_type": "yarn", "factor": 64.0}


@pytest.fixture
def traced(monkeypatch):
    seen = []

    def trace(model, *, seq_len, dtype="bfloat16", seq_tile=None, compile_blocks=False):
        seen.append(seq_len)
        return chain(4, seq_len=seq_len, hidden=1024, layer_params=20_000_000, saved_per_token=200_000)
    # where it is called (``api`` imports it when it traces)
    for where in ("lazytrain.compiler.seq_search.trace", "lazytrain.frontend.trace.trace"):
        monkeypatch.setattr(where, trace)
    return seen


def _fits(seq: int, **budget) -> bool:
    from lazytrain.compiler.api import Compiler, make_budgets
    from lazytrain.compiler.profiles import get_profile
    budgets = make_budgets(get_profile("h200"), budget.get("gpu_memory"), budget.get("host_memory"))
    g = chain(4, seq_len=seq, hidden=1024, layer_params=20_000_000, saved_per_token=200_000)
    comp = Compiler(g, get_profile("h200"), budgets, param_dtype="bfloat16", optimizer="adamw", clip=True)
    return seq_search.binding(seq_search._leanest(comp, "milp", 2, None), budgets) is None


@pytest.mark.parametrize("gpu", ["3GiB", "8GiB"])
def test_the_answer_fits_and_one_step_more_does_not(traced, gpu):
    plan = lazytrain.compile(_Model(rope_scaling=YARN), seq_len="max", gpu_memory=gpu, **OPTIONS)
    seq = plan.seq_len
    assert seq % seq_search._step(seq) == 0 and seq > 1024
    assert _fits(seq, gpu_memory=gpu, host_memory="64GiB")
    assert not _fits(seq + seq_search._step(seq), gpu_memory=gpu, host_memory="64GiB")
    note = plan.decisions.notes["seq_search"]
    assert note.startswith(f"longest feasible seq {seq} at batch 2; seq ") and "GPU memory: its leanest plan" in note
    assert "beyond the model's 4096 declared positions: its rope scaling covers them" in note
    assert plan.predicted["peak_gpu_bytes"] <= plan.budgets["gpu_bytes"]
    assert len(set(traced)) <= 16     # lengths probed: doubling from 1024, then bisection to 1/64


def test_the_answer_stops_at_the_declared_positions_without_rope_scaling(traced):
    plan = lazytrain.compile(_Model(4096), seq_len="max", gpu_memory="8GiB", **OPTIONS)
    assert plan.seq_len == 4096
    assert plan.decisions.notes["seq_search"].startswith("seq 4096: the positions the model declares")
    assert max(traced) == 4096


def test_host_memory_can_be_what_binds(traced):
    plan = lazytrain.compile(_Model(1 << 20), seq_len="max", gpu_memory="80GiB",
                             **{**OPTIONS, "host_memory": "3GiB"})
    note = plan.decisions.notes["seq_search"]
    assert "host memory" in note and "max_position_embeddings" not in note


def test_nothing_fits_and_bad_requests_are_one_line_errors(traced):
    with pytest.raises(BudgetError, match=r"^no sequence of 128 tokens or more fits batch 2 \(seq 128: GPU memory"):
        lazytrain.compile(_Model(), seq_len="max", gpu_memory="1.6GiB", **OPTIONS)
    with pytest.raises(ValueError, match="^seq_len='max' needs a fixed batch"):
        lazytrain.compile(_Model(), seq_len="max", **{**OPTIONS, "batch_size": "max"})
    with pytest.raises(ValueError, match="^seq_len='max' needs the model"):
        lazytrain.compile(chain(2), seq_len="max", **OPTIONS)


def test_the_command_line_takes_seq_max():
    from lazytrain.app.cli import build_parser
    a = build_parser().parse_args(["compile", "tiny", "--seq", "max", "--batch", "4"])
    assert a.seq == "max" and a.batch == 4 and a.seq_tile == "auto"
    assert build_parser().parse_args(["compile", "tiny", "--seq-tile", "none"]).seq_tile is None
    assert build_parser().parse_args(["compile", "tiny", "--seq-tile", "2048"]).seq_tile == 2048


def test_a_host_budget_that_binds_is_named_not_the_gpu():
    g = chain(8, seq_len=65536, hidden=4096, layer_params=20_000_000, saved_per_token=200_000)
    want = (r"^no plan fits every budget for batch 2, seq 65536: the plan leanest on GPU memory needs .* of the "
            r"22.00 GiB, but host memory: .* over the budget of 7.00")
    with pytest.raises(BudgetError, match=want):
        lazytrain.compile(g, batch_size=2, gpu_memory="22GiB", host_memory="7GiB", optimizer="adamw", hardware="h200")


def test_the_default_host_budget_leaves_a_reserve_and_the_model_the_caller_holds():
    from lazytrain.compiler.budgets import host_reserve
    from lazytrain.compiler.profiles import get_profile
    from lazytrain.frontend.presets import build_model
    model = build_model("tiny", device="cpu")
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    total = get_profile("h200").host_memory_bytes
    plan = lazytrain.compile(model, batch_size=2, seq_len=64, hardware="h200", policy="recompute-all")
    assert plan.budgets["host_bytes"] == total - host_reserve(total) - held
    assert lazytrain.compile("tiny", batch_size=2, seq_len=64, hardware="h200",
                             policy="recompute-all").budgets["host_bytes"] == total - host_reserve(total)


def test_with_calibration_a_length_whose_measured_transients_do_not_fit_steps_down(traced, monkeypatch):
    """Calibration measures the blocks at the answer; where their measured transients push the plan over the
    budget, a length 1/16 shorter is tried (measured again), and the note says why the longer one failed."""
    from lazytrain.compiler.api import compile_request
    asked = []

    def calibrated(model, req):       # stands for compile_calibrated: the first length measures too big
        asked.append(req.seq_len)
        if len(asked) == 1:
            raise BudgetError("needs at least 9.00 GiB of GPU memory")
        return compile_request(seq_search.trace(model, seq_len=req.seq_len), dataclasses.replace(req, calibrate=False))
    options = dict(model=_Model(rope_scaling=YARN), seq_len="max", gpu_memory="3GiB", calibrate=True, **OPTIONS)
    first = lazytrain.compile(**{**options, "calibrate": False}).seq_len
    monkeypatch.setattr("lazytrain.measure.calibrate.compile_calibrated", calibrated)
    plan = lazytrain.compile(**options)
    assert asked[0] == first and plan.seq_len == asked[-1] < first, asked
    assert plan.seq_len % seq_search._step(plan.seq_len) == 0
    note = plan.decisions.notes["seq_search"]
    assert f"seq {first} does not fit: the measured transients do not fit: needs at least 9.00 GiB" in note
