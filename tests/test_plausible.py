"""The profiler's checks: physical limits with a tolerance, and re-measuring what crosses one."""

from __future__ import annotations

import pytest

from lazytrain.compiler.plausible import RETRIES, ImplausibleMeasurement, measure_checked, problems

H200 = {"h2d_gbps": 55.4, "d2h_gbps": 55.4, "duplex_gbps": 99.6, "pageable_h2d_gbps": 8.9, "pageable_d2h_gbps": 15.7}


def test_measured_h200_figures_are_plausible():
    assert problems({**H200, "bf16_tflops": 770.0, "attn_fwd_tflops": 552.0, "attn_bwd_tflops": 480.0,
                     "attn_half_len": 385.0, "compute_efficiency": 0.59, "kernel_overhead_s": 3.6e-4,
                     "op_dispatch_s": 30e-6, "op_dispatch_bwd_s": 63e-6}) == []


@pytest.mark.parametrize(("duplex", "ok"), [(56.0, True),    # a link that cannot overlap the two ways is no error
                                             (52.0, True),    # one after the other, within noise
                                             (45.0, False),   # slower than one after the other
                                             (125.0, False)])  # faster than both at full rate
def test_duplex_lies_between_serial_and_the_sum(duplex, ok):
    found = problems({**H200, "duplex_gbps": duplex})
    assert (found == []) is ok, found
    if not ok:
        assert "duplex_gbps" in found[0]


def test_each_limit_names_its_figure():
    bad = {"pageable_h2d_gbps": 70.0, "h2d_gbps": 55.0, "d2h_gbps": 2000.0, "bf16_tflops": 770.0,
           "attn_fwd_tflops": 900.0, "attn_half_len": -1.0, "compute_efficiency": 1.2, "op_dispatch_s": 2e-3,
           "kernel_overhead_s": 0.02}
    text = "; ".join(problems(bad))
    for name in ("pageable_h2d_gbps 70 beats h2d_gbps", "d2h_gbps 2e+03", "attn_fwd_tflops 900",
                 "attn_half_len -1 is negative", "compute_efficiency 1.2", "op_dispatch_s", "kernel_overhead_s"):
        assert name in text


def test_a_figure_past_a_limit_is_measured_again_then_refused():
    tries = iter([{"h2d_gbps": -1.0}, {"h2d_gbps": 55.0}])
    assert measure_checked("copies", lambda: next(tries)) == {"h2d_gbps": 55.0}
    calls = []
    with pytest.raises(ImplausibleMeasurement, match=r"^implausible measurement of copies on 3 tries: h2d_gbps -1"):
        measure_checked("copies", lambda: calls.append(1) or {"h2d_gbps": -1.0})
    assert len(calls) == RETRIES + 1
