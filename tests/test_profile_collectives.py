"""The collectives' measurement of ``lazytrain profile`` (``profile_collectives``): the fit recovers the cost
model's bandwidth and latency from times the model itself predicts, and the measuring processes run (gloo
on the CPU: NCCL needs GPUs) and give figures the plausibility checks accept."""

import dataclasses

import pytest

from lazytrain.compiler.plausible import problems
from lazytrain.compiler.profiles import get_profile
from lazytrain.measure.profile_collectives import fit, measure_collectives


@pytest.mark.parametrize("world", [2, 8])
def test_the_fit_recovers_the_cost_models_bandwidth_and_latency(world):
    hw = dataclasses.replace(get_profile("h200"), collective_gbps=150.0, collective_latency_s=12e-6)
    points = [(world, n, hw.collective_seconds(n, world)) for n in (1 << 20, 1 << 24, 1 << 28)]
    got = fit(points)
    assert got["collective_gbps"] == pytest.approx(150.0, rel=1e-6)
    assert got["collective_latency_s"] == pytest.approx(12e-6, rel=1e-6)
    with pytest.raises(ValueError, match="do not grow with the buffer"):
        fit([(world, 1 << 20, 1e-3), (world, 1 << 24, 1e-4)])
    with pytest.raises(ValueError, match="two buffer sizes"):
        fit(points[:1])


def test_two_gloo_processes_measure_plausible_figures():
    got = measure_collectives(2, "gloo", sizes=(16 << 10, 1 << 20, 4 << 20), repeats=3)
    assert set(got) == {"collective_gbps", "collective_latency_s"}
    assert not problems(got), got
