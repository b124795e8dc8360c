import dataclasses
import json

import pytest

from lazytrain.compiler.hardware import HardwareProfile, attention_flops, layer_flops
from lazytrain.compiler.profiles import EAGER_LAYER_EFFICIENCY, EXPORTED_BLOCK_SLOWDOWN, PROFILES, get_profile

GiB = 2**30
QWEN3B_LAYER_PARAMS = 77_076_992  # Qwen2.5-3B decoder layer: hidden 2048, 16 q heads, 2 kv heads, MLP 11008


def test_builtins_exist_and_are_named_by_their_key():
    assert {"h200", "h100", "h800", "a100-80g", "rtx3090", "rtx4090", "workstation", "workstation-4nvme",
            "cpu"} <= set(PROFILES)
    for key, profile in PROFILES.items():
        assert profile.name == key
        assert profile.source
        assert profile.duplex_gbps <= profile.h2d_gbps + profile.d2h_gbps


def test_h200_is_the_design_measurement():
    p = PROFILES["h200"]
    assert (p.h2d_gbps, p.d2h_gbps, p.duplex_gbps) == (55.4, 55.4, 99.6)
    assert (p.pageable_h2d_gbps, p.pageable_d2h_gbps) == (8.9, 15.7)
    assert (p.bf16_tflops, p.cpu_adam_gparams, p.cpu_cores) == (770.0, 5.5, 16)
    assert (p.nvme_read_gbps, p.nvme_write_gbps) == (1.6, 1.6)
    assert (p.gpu_memory_bytes, p.host_memory_bytes) == (139 * GiB, 125 * GiB)


@pytest.mark.parametrize(
    ("micro_batch", "forward_ms", "forward_backward_ms"),
    [(8, 2.77, 8.48), (4, None, 4.62)],
)
def test_h200_calibration_reproduces_one_qwen_layer(micro_batch, forward_ms, forward_backward_ms):
    """benchmarks/results/h200_reference.md: one eager Qwen2.5-3B layer at micro-batch 8 x 1024, forward
    2.77 ms, fwd+bwd 8.48 ms."""
    p = dataclasses.replace(PROFILES["h200"], compute_efficiency=EAGER_LAYER_EFFICIENCY)
    matmuls = 2 * QWEN3B_LAYER_PARAMS * micro_batch * 1024
    attn, attn_bwd = (attention_flops(micro_batch, 1024, 2048, backward=b) for b in (False, True))
    assert matmuls + attn == layer_flops(QWEN3B_LAYER_PARAMS, micro_batch, 1024, 2048)
    forward = p.block_seconds(matmuls + attn, attn_flops=attn, kv_len=1024)
    backward = p.block_seconds(2 * matmuls + attn_bwd, attn_flops=attn_bwd, kv_len=1024, backward=True)
    if forward_ms is not None:
        assert forward * 1e3 == pytest.approx(forward_ms, rel=0.05)
    assert (forward + backward) * 1e3 == pytest.approx(forward_backward_ms, rel=0.05)


def test_h200_efficiency_is_the_eager_fit_scaled_by_the_measured_block_slowdown():
    assert PROFILES["h200"].compute_efficiency == pytest.approx(EAGER_LAYER_EFFICIENCY / EXPORTED_BLOCK_SLOWDOWN)
    assert 1.1 < EXPORTED_BLOCK_SLOWDOWN < 1.2


def test_layer_flops_counts_causal_attention_as_half():
    dense = 2 * QWEN3B_LAYER_PARAMS * 8 * 1024
    full = layer_flops(QWEN3B_LAYER_PARAMS, 8, 1024, 2048, causal=False)
    causal = layer_flops(QWEN3B_LAYER_PARAMS, 8, 1024, 2048)
    assert full - dense == 4 * 8 * 1024**2 * 2048
    assert causal - dense == (full - dense) / 2
    assert causal == pytest.approx(1.297e12, rel=1e-3)


def test_times():
    p = PROFILES["h200"]
    assert p.h2d_seconds(55.4e9) == pytest.approx(1.0)
    assert p.d2h_seconds(15.7e9, pinned=False) == pytest.approx(1.0)
    assert p.matmul_seconds(770e12) == pytest.approx(1.0)
    assert p.update_seconds(5.5e9, eight_bit=False) == pytest.approx(1.0)
    assert p.update_seconds(5.0e9, eight_bit=True) == pytest.approx(1.0)   # measured in the runtime
    assert p.nvme_seconds(1.6e9, write=True) == pytest.approx(1.0)
    assert p.block_seconds(0.0, launches=3) == pytest.approx(3 * p.kernel_overhead_s)
    assert p.block_seconds(1e12) > p.matmul_seconds(1e12)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_json_round_trip(name, tmp_path):
    profile = PROFILES[name]
    data = json.loads(json.dumps(profile.to_json()))
    assert data["format"] == "lazytrain.hardware" and data["version"] == 1
    assert HardwareProfile.from_json(data) == profile
    path = tmp_path / "hw.json"
    profile.save(path)
    assert get_profile(str(path)) == profile
    assert get_profile(path) == profile


def test_from_json_rejects_unknown_missing_and_bad_fields():
    good = PROFILES["h200"].to_json()
    with pytest.raises(ValueError, match=r"unknown fields \['pcie_gen'\]"):
        HardwareProfile.from_json({**good, "pcie_gen": 5})
    missing = dict(good)
    del missing["h2d_gbps"]
    with pytest.raises(ValueError, match=r"missing fields \['h2d_gbps'\]"):
        HardwareProfile.from_json(missing)
    with pytest.raises(ValueError, match="h2d_gbps must be positive"):
        HardwareProfile.from_json({**good, "h2d_gbps": 0})
    with pytest.raises(ValueError, match="h2d_gbps must be a number"):
        HardwareProfile.from_json({**good, "h2d_gbps": "fast"})
    with pytest.raises(ValueError, match="cpu_cores must be a whole number"):
        HardwareProfile.from_json({**good, "cpu_cores": 1.5})
    with pytest.raises(ValueError, match="compute_efficiency is a fraction"):
        HardwareProfile.from_json({**good, "compute_efficiency": 1.5})
    with pytest.raises(ValueError, match="version 2 is not supported"):
        HardwareProfile.from_json({**good, "version": 2})
    with pytest.raises(ValueError, match="not a hardware profile"):
        HardwareProfile.from_json({**good, "format": "lazytrain.plan"})
    with pytest.raises(ValueError, match="JSON object"):
        HardwareProfile.from_json([1, 2])
    # JSON writes 16.0 for an int field and 55 for a float one: both are read back
    assert HardwareProfile.from_json({**good, "cpu_cores": 16.0, "h2d_gbps": 55}).cpu_cores == 16


def test_nvme_fields_round_trip_and_old_files_without_them_load(tmp_path):
    p = dataclasses.replace(PROFILES["h200"], nvme_both_gbps=2.5, nvme_queue_depth=8, nvme_request_bytes=8 << 20)
    path = tmp_path / "hw.json"
    p.save(path)
    assert HardwareProfile.load(path) == p and p.nvme_mixed_gbps() == 2.5
    old = PROFILES["rtx4090"].to_json()
    for k in ("nvme_both_gbps", "nvme_queue_depth", "nvme_request_bytes"):
        del old[k]
    loaded = HardwareProfile.from_json(old)
    assert (loaded.nvme_both_gbps, loaded.nvme_queue_depth, loaded.nvme_request_bytes) == (0.0, 0, 0)
    assert loaded.nvme_mixed_gbps() == max(loaded.nvme_read_gbps, loaded.nvme_write_gbps) == 6.0
    with pytest.raises(ValueError, match="nvme_queue_depth must be a whole number"):
        HardwareProfile.from_json({**p.to_json(), "nvme_queue_depth": 2.5})
    with pytest.raises(ValueError, match="nvme_both_gbps must be positive"):
        HardwareProfile.from_json({**p.to_json(), "nvme_both_gbps": -1.0})


def test_workstation_profiles_are_an_rtx4090_on_a_128_gib_host_with_one_or_four_drives():
    one, four, gpu = PROFILES["workstation"], PROFILES["workstation-4nvme"], PROFILES["rtx4090"]
    for p in (one, four):
        assert (p.gpu_name, p.gpu_memory_bytes, p.bf16_tflops, p.h2d_gbps) == \
            (gpu.gpu_name, gpu.gpu_memory_bytes, gpu.bf16_tflops, gpu.h2d_gbps)
        assert (p.host_memory_bytes, p.cpu_cores) == (128 * GiB, 16)
        assert (p.nvme_queue_depth, p.nvme_request_bytes) == (8, 8 << 20)
        serial = 2 / (1 / p.nvme_read_gbps + 1 / p.nvme_write_gbps)
        assert serial <= p.nvme_mixed_gbps() <= p.nvme_read_gbps + p.nvme_write_gbps
    assert (one.nvme_read_gbps, one.nvme_write_gbps, one.nvme_both_gbps) == (6.5, 3.5, 5.0)
    assert (four.nvme_read_gbps, four.nvme_write_gbps, four.nvme_both_gbps) == (22.0, 12.0, 16.0)


def test_profile_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROFILES["h200"].h2d_gbps = 1.0


def test_get_profile_names_and_errors(tmp_path):
    assert get_profile("h200") is PROFILES["h200"]
    assert get_profile("RTX4090") is PROFILES["rtx4090"]
    assert get_profile(PROFILES["h100"]) is PROFILES["h100"]
    with pytest.raises(ValueError, match="unknown hardware 'b200': use one of h200, h100, h800, a100-80g"):
        get_profile("b200")
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        get_profile(str(bad))
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"format": "lazytrain.hardware", "version": 1, "name": "x"}))
    with pytest.raises(ValueError, match="partial.json: bad hardware profile: missing fields"):
        get_profile(str(partial))


def test_measure_quick_on_cpu(tmp_path):
    from lazytrain.measure.profile import measure

    profile = measure(device="cpu", quick=True, disk_dir=str(tmp_path), verbose=False)
    assert profile.gpu_name == "CPU (no GPU)" and "without CUDA" in profile.source
    for field in dataclasses.fields(profile):
        value = getattr(profile, field.name)
        # zero is a measurement for these (no fixed cost, dispatch inside the compute, no length effect); the
        # in-step copy rates are 0 until a plan's step measures them (``step_rates``)
        if not isinstance(value, (str, tuple)) and field.name not in ("kernel_overhead_s", "op_dispatch_s",
                                                                      "op_dispatch_bwd_s", "attn_half_len",
                                                                      "param_load_gbps", "grad_offload_gbps"):
            assert value > 0, field.name
    assert profile.attn_half_len >= 0 and profile.calibration == ()
    assert profile.op_dispatch_s == 0.0          # CPU mode: dispatch is part of the compute it measured
    assert 0 < profile.compute_efficiency <= 1
    assert list(tmp_path.iterdir()) == []  # the disk test cleans up
    assert HardwareProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


@pytest.mark.cuda
def test_measure_quick_on_gpu():
    """Measured figures are checked against physical limits, not against each other (two noisy medians,
    e.g. duplex > h2d, can be either way on a machine where both are right): ``measure`` re-measures a
    figure past a limit and raises if it stays there, and the profile it returns is within them all."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from lazytrain.compiler.plausible import problems
    from lazytrain.measure.profile import measure

    profile = measure(quick=True, verbose=False)
    assert problems(dataclasses.asdict(profile)) == []
    # on a GPU these are measured (0 would mean "not modelled")
    assert profile.op_dispatch_s > 0 and profile.op_dispatch_bwd_s > 0
    assert profile.attn_fwd_tflops > 0 and profile.attn_bwd_tflops > 0
