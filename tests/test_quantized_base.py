"""A quantized frozen base (``runtime/quantized.py``): NF4 and int8 segments dequantize to torchao's own round trip
bit for bit, with the error figures QLoRA's format gives; pieces of any size, raw pieces, the byte-buffer views,
the safetensors file, and the compiler's bytes (``compiler/quant_cost.py``) equal to the runtime's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

torchao = pytest.importorskip("torchao")

from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quant_primitives import dequantize_affine  # noqa: E402

from lazytrain.compiler.hardware import HardwareProfile  # noqa: E402
from lazytrain.compiler.profiles import get_profile  # noqa: E402
from lazytrain.compiler.quant_cost import frozen_cost  # noqa: E402
from lazytrain.ir.graph import ParamSpec  # noqa: E402
from lazytrain.runtime.quantized import Piece, QuantizedSegment, bytes_per_param, pieces_of  # noqa: E402
from lazytrain.util import quant_format  # noqa: E402

GROUP = 64 * quant_format.SCALER_BLOCK


def _weights(n: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


def _rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_round_trip_is_torchaos_bit_for_bit(dtype):
    x = _weights(4 * GROUP, dtype)
    seg = QuantizedSegment.quantize(x, 4)
    out = seg.dequantize()
    assert out.dtype == dtype
    assert torch.equal(out, to_nf4(x, 64, 256).get_original_weight())
    # QLoRA's NF4 on normal weights: ~9% relative error (measured 0.092 at bf16 and fp32)
    assert 0.08 < _rel_error(out, x) < 0.10


def test_nf4_of_a_real_shaped_matrix_is_torchaos_bit_for_bit():
    w = _weights(256 * 320, seed=1).view(256, 320)  # a linear weight whose size is a whole group
    seg = QuantizedSegment.quantize(w.flatten(), 4)
    assert torch.equal(seg.dequantize().view(256, 320), to_nf4(w, 64, 256).get_original_weight())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_round_trip_is_torchaos_bit_for_bit(dtype):
    x = _weights(3 * 64 * 100, dtype)
    seg = QuantizedSegment.quantize(x, 8)
    t = seg.host_tensors()
    ref = dequantize_affine(t["codes"].view(-1, 64), (1, 64), t["scales"].view(-1, 1), None, torch.int8, -127, 127,
                            output_dtype=dtype).flatten()
    out = seg.dequantize()
    assert torch.equal(out, ref)
    # block-wise absmax int8 on normal weights: ~0.6% relative error (measured 0.0062 bf16, 0.0059 fp32)
    assert 0.004 < _rel_error(out, x) < 0.008
    # absmax: each block's largest value is exact up to the scale's rounding, codes within -127..127
    assert t["codes"].abs().max() <= 127


def _segment(sizes_and_kinds, dtype=torch.bfloat16):
    pieces, offset = [], 0
    for numel, quantized in sizes_and_kinds:
        pieces.append(Piece(offset, numel, quantized))
        offset += numel
    return _weights(offset, dtype, seed=2), tuple(pieces)


#: a norm (kept), sizes not a multiple of the block, a tiny one, a whole block
ODD = [(100, False), (4096, True), (37, True), (640, True), (3, False), (64, True)]


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_pieces_of_any_size_dequantize_each_on_its_own_blocks(bits):
    x, pieces = _segment(ODD)
    seg = QuantizedSegment.quantize(x, bits, pieces=pieces)
    out = seg.dequantize()
    for p in pieces:
        got, want = out[p.offset:p.offset + p.numel], x[p.offset:p.offset + p.numel]
        if not p.quantized or bits == 16:
            assert torch.equal(got, want)
        else:
            # each piece on its own, zero-padded to whole blocks: the same codes as quantizing it alone
            alone = QuantizedSegment.quantize(want, bits).dequantize() if bits == 8 else None
            if alone is not None:
                assert torch.equal(got, alone)
            assert _rel_error(got, want) < (0.12 if bits == 4 else 0.01)


def test_nf4_pieces_match_torchao_on_the_padded_stream():
    x, pieces = _segment(ODD)
    seg = QuantizedSegment.quantize(x, 4, pieces=pieces)
    stream = []
    for p in pieces:
        if p.quantized:
            v = x[p.offset:p.offset + p.numel]
            stream += [v, torch.zeros(-p.numel % 64, dtype=x.dtype)]
    stream = torch.cat(stream)
    stream = torch.cat([stream, torch.zeros(-stream.numel() % GROUP, dtype=x.dtype)])
    ref = to_nf4(stream, 64, 256).get_original_weight()
    out, at = seg.dequantize(), 0
    for p in pieces:
        if p.quantized:
            assert torch.equal(out[p.offset:p.offset + p.numel], ref[at:at + p.numel])
            at += -(-p.numel // 64) * 64


def test_chunks_bound_the_temporaries_and_keep_torchaos_values(monkeypatch):
    """A stream of several chunks (the chunk made small here): each chunk is one torchao NF4 tensor."""
    import lazytrain.runtime.quantized as q
    monkeypatch.setattr(q, "CHUNK", 2 * GROUP)
    monkeypatch.setattr(quant_format, "CHUNK", 2 * GROUP)
    x = _weights(5 * GROUP + 100)
    seg = QuantizedSegment.quantize(x, 4, pieces=[Piece(0, 5 * GROUP + 100, True)])
    assert seg.host_tensors()["means"].numel() == 3
    out = seg.dequantize()
    for start in range(0, 4 * GROUP + 1, 2 * GROUP):
        part = x[start:start + 2 * GROUP]
        part = torch.cat([part, torch.zeros(-part.numel() % GROUP, dtype=x.dtype)])
        ref = to_nf4(part, 64, 256).get_original_weight()
        n = min(2 * GROUP, x.numel() - start)
        assert torch.equal(out[start:start + n], ref[:n])


@pytest.mark.parametrize("bits", [4, 8])
def test_sections_view_into_a_byte_buffer_and_dequantize_from_it(bits):
    x, pieces = _segment(ODD)
    seg = QuantizedSegment.quantize(x, bits, pieces=pieces)
    buffer = torch.full((seg.nbytes + 32,), 0xAB, dtype=torch.uint8)
    views = seg.copy_into(buffer[16:])
    for name, view in views.items():
        assert view.data_ptr() % quant_format.ALIGN == 0
        assert torch.equal(view, seg.host_tensors()[name])
    dst = torch.empty_like(x)
    seg.dequantize_into(dst, seg.views(buffer[16:]))
    assert torch.equal(dst, seg.dequantize())
    assert sum(t.numel() * t.element_size() for t in views.values()) <= seg.nbytes


def test_dequantize_into_refuses_a_wrong_destination_and_buffer():
    seg = QuantizedSegment.quantize(_weights(GROUP), 4)
    with pytest.raises(ValueError, match="dequantizes into a flat"):
        seg.dequantize_into(torch.empty(GROUP, dtype=torch.float32), seg.host_tensors())
    with pytest.raises(ValueError, match="needs a flat uint8 buffer"):
        seg.views(torch.empty(seg.nbytes - 1, dtype=torch.uint8))


def test_quantize_refuses_bad_arguments():
    x = _weights(128)
    with pytest.raises(ValueError, match="base bits must be one of"):
        QuantizedSegment.quantize(x, 3)
    with pytest.raises(ValueError, match="quantization block size must be"):
        QuantizedSegment.quantize(x, 4, block_size=48)
    with pytest.raises(ValueError, match="pieces must cover it in order"):
        QuantizedSegment.quantize(x, 4, pieces=[Piece(0, 64, True), Piece(70, 58, True)])
    with pytest.raises(ValueError, match="pieces cover"):
        QuantizedSegment.quantize(x, 4, pieces=[Piece(0, 64, True)])
    with pytest.raises(ValueError, match="a frozen segment is a flat"):
        QuantizedSegment.quantize(x.view(2, 64), 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_safetensors_file_round_trip_and_digest(bits, tmp_path):
    x, pieces = _segment(ODD)
    seg = QuantizedSegment.quantize(x, bits, pieces=pieces)
    seg.save(tmp_path / "base.safetensors")
    back = QuantizedSegment.load(tmp_path / "base.safetensors")
    assert back.header() == seg.header() and back.digest() == seg.digest()
    assert torch.equal(back.dequantize(), seg.dequantize())
    other = QuantizedSegment.quantize(x.clone().index_fill_(0, torch.tensor([200]), 1.0), bits, pieces=pieces)
    assert other.digest() != seg.digest()


def test_load_refuses_other_files(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="is not a quantized segment file"):
        QuantizedSegment.load(tmp_path / "plain.safetensors")
    seg = QuantizedSegment.quantize(_weights(GROUP), 4)
    with pytest.raises(ValueError, match="not a quantized segment file of this LazyTrain"):
        QuantizedSegment.from_parts({**seg.header(), "version": 99}, seg.host_tensors())
    with pytest.raises(ValueError, match="another chunk layout"):
        QuantizedSegment.from_parts({**seg.header(), "chunk": 12}, seg.host_tensors())
    tensors = seg.host_tensors()
    tensors["codes"] = tensors["codes"][:-1]
    with pytest.raises(ValueError, match="sections do not match its header"):
        QuantizedSegment.from_parts(seg.header(), tensors)
    assert json.loads(json.dumps(seg.header())) == seg.header()


def test_pieces_of_keeps_norms_biases_and_embeddings_raw():
    pieces = pieces_of([("model.embed_tokens.weight", (10, 8)), ("self_attn.q_proj.weight", (8, 8)),
                        ("input_layernorm.weight", (8,)), ("self_attn.q_proj.bias", (8,)), ("lm_head.weight", (10, 8))])
    assert [p.quantized for p in pieces] == [False, True, False, False, False]
    assert [p.offset for p in pieces] == [0, 80, 144, 152, 160]


def test_bytes_per_param():
    assert bytes_per_param(4, 64) == pytest.approx(0.5 + 1 / 64 + 2 / 16384)
    assert bytes_per_param(8, 64) == pytest.approx(1.0625)
    assert bytes_per_param(16) == 2.0


# a 7B (Llama-2) layer's parameters, in a block's order
LAYER_7B = [("self_attn.q_proj.weight", (4096, 4096)), ("self_attn.k_proj.weight", (4096, 4096)),
            ("self_attn.v_proj.weight", (4096, 4096)), ("self_attn.o_proj.weight", (4096, 4096)),
            ("mlp.gate_proj.weight", (11008, 4096)), ("mlp.up_proj.weight", (11008, 4096)),
            ("mlp.down_proj.weight", (4096, 11008)), ("input_layernorm.weight", (4096,)),
            ("post_attention_layernorm.weight", (4096,))]


@pytest.mark.parametrize("bits", [4, 8])
def test_compiler_bytes_are_the_runtimes(bits):
    params = [ParamSpec(name="layers.0.self_attn.q_proj.weight", shape=(64, 65), owner=0),
              ParamSpec(name="layers.0.input_layernorm.weight", shape=(70,), owner=0),
              ParamSpec(name="layers.0.mlp.down_proj.weight", shape=(33, 7), owner=0)]
    x = _weights(sum(p.numel for p in params))
    seg = QuantizedSegment.quantize(x, bits, pieces=pieces_of((p.name, p.shape) for p in params))
    cost = frozen_cost(params, bits, 2, get_profile("h100"))
    assert cost.load_bytes == seg.nbytes
    assert cost.param_bytes == x.numel() * 2 == frozen_cost(params, 16, 2, get_profile("h100")).load_bytes


def test_frozen_cost_of_a_7b_layer():
    hw = get_profile("h100")
    params = [ParamSpec(name=f"layers.0.{n}", shape=s, owner=0) for n, s in LAYER_7B]
    n = sum(p.numel for p in params)
    bf16, nf4, int8 = (frozen_cost(params, b, 2, hw) for b in (16, 4, 8))
    assert bf16.load_bytes == 2 * n and bf16.dequant_seconds == 0
    assert nf4.load_bytes == pytest.approx((n - 8192) * bytes_per_param(4) + 8192 * 2, rel=1e-4)
    assert int8.load_bytes == pytest.approx((n - 8192) * bytes_per_param(8) + 8192 * 2, rel=1e-4)
    assert nf4.dequant_seconds == pytest.approx((n - 8192) * 2 / (hw.dequant_gbps * 1e9))
    assert int8.dequant_seconds == pytest.approx((n - 8192) * 2 / (hw.dequant8_gbps * 1e9))
    slow = dataclasses.replace(hw, dequant_gbps=hw.dequant_gbps / 2)
    assert frozen_cost(params, 4, 2, slow).dequant_seconds == pytest.approx(2 * nf4.dequant_seconds)


def test_profiles_carry_dequant_rates_and_old_files_load(tmp_path):
    for name in ("h100", "h200", "rtx4090", "cpu"):
        hw = get_profile(name)
        assert hw.dequant8_gbps > hw.dequant_gbps > 0
    data = json.loads(json.dumps(get_profile("h100").to_json()))
    data.pop("dequant_gbps"), data.pop("dequant8_gbps")
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = HardwareProfile.load(tmp_path / "old.json")
    fields = {f.name: f.default for f in dataclasses.fields(HardwareProfile)}
    assert (old.dequant_gbps, old.dequant8_gbps) == (fields["dequant_gbps"], fields["dequant8_gbps"])


def test_dequant_rates_are_measured_on_the_cpu_and_checked_against_memory():
    from lazytrain.compiler.plausible import problems
    from lazytrain.measure.dequant import dequant_rates, layer_params, synthetic_segment

    seg = synthetic_segment(4, layer_params(64))
    assert seg.numel == sum(torch.Size(s).numel() for _, s in layer_params(64))
    assert torch.isfinite(seg.dequantize().float()).all()
    rates = dequant_rates(torch.device("cpu"), quick=True, repeats=1)
    assert set(rates) == {"dequant_gbps", "dequant8_gbps"} and min(rates.values()) > 0
    assert problems(rates) == []
    assert problems({"dequant_gbps": 1e5}) and problems({"dequant8_gbps": 0.0})


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_on_cuda_dequantize_gives_the_cpus_values(bits):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, pieces = _segment(ODD + [(2 * GROUP + 5, True)])
    on_cpu = QuantizedSegment.quantize(x, bits, pieces=pieces)
    assert torch.equal(on_cpu.dequantize("cuda").cpu(), on_cpu.dequantize())
    # torchao quantizing on the GPU (its reductions may round the scalers' mean otherwise than the CPU's)
    on_gpu = QuantizedSegment.quantize(x, bits, pieces=pieces, device="cuda")
    assert _rel_error(on_gpu.dequantize("cuda").cpu(), x) < (0.12 if bits == 4 else 0.01)
