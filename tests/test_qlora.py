"""LoRA on a quantized frozen base (QLoRA, issue #44): the host store holds each block's frozen segment packed (NF4
or int8), a load moves the packed bytes and dequantizes them on the device, and the adapters train exactly as
PEFT's eager model does on the base replaced by torchao's own quantize -> dequantize round trip (fp32, CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("torchao")

from test_lora import BUDGETS, EPS, FORCED, LR, SEQ, B, _batches, _lora_model, train_beside_eager  # noqa: E402
from torchao.quantization import to_nf4  # noqa: E402
from torchao.quantization.quant_primitives import (  # noqa: E402
    MappingType,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)

import lazytrain  # noqa: E402
from lazytrain.compiler.api import Compiler  # noqa: E402
from lazytrain.compiler.cost import CostModel  # noqa: E402
from lazytrain.compiler.profiles import get_profile  # noqa: E402
from lazytrain.compiler.quant_cost import frozen_cost  # noqa: E402
from lazytrain.frontend.trace import trace  # noqa: E402
from lazytrain.hf.export import trainer_weights  # noqa: E402
from lazytrain.ir import Decisions, GiB, OpKind, Plan, Sizes  # noqa: E402
from lazytrain.ir.semantics import effects  # noqa: E402
from lazytrain.runtime.optim.torch_adamw import TorchAdamW  # noqa: E402
from lazytrain.runtime.trainer import Trainer  # noqa: E402
from lazytrain.util.quant_format import SCALER_BLOCK, packed_nbytes, quantized_param  # noqa: E402

QB = 64


def _plan(model, how: str, bits: int) -> Plan:
    if how == "keep-all":
        return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", policy="keep-all",
                                 param_dtype="float32", optimizer="adamw", base_bits=bits, **BUDGETS)
    graph = trace(model, seq_len=SEQ, dtype="float32")
    comp = Compiler(graph, get_profile("cpu"), {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB}, param_dtype="float32",
                    optimizer="adamw", clip=True, base_bits=bits)
    boundary, saved = FORCED[how]
    placed = {"resident": (True, True, False, False), "gpu_update": (False, False, True, False)} \
        if how == "resident+gpu-updated" else {}
    plan = comp.build(Decisions(policy=how, micro_batch=2, n_micro=B // 2, boundary=boundary, saved=saved, **placed),
                      B)
    assert plan.options["base_bits"] == bits
    return plan


def _round_trip_nf4(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """torchao's NF4 round trip of one block's matrices as one segment: each padded to whole blocks of 64, the stream
    to a whole group (the runtime's layout, ``util.quant_format``), quantized as one torchao tensor."""
    parts, sizes = [], []
    for w in weights:
        flat = w.detach().flatten()
        pad = -flat.numel() % QB
        parts.append(torch.cat([flat, flat.new_zeros(pad)]))
        sizes.append(flat.numel() + pad)
    stream = torch.cat(parts)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % (QB * SCALER_BLOCK))])
    back = to_nf4(stream, QB, SCALER_BLOCK).get_original_weight()
    out, at = [], 0
    for w, n in zip(weights, sizes):
        out.append(back[at:at + w.numel()].view(w.shape))
        at += n
    return out


def _round_trip_int8(w: torch.Tensor) -> torch.Tensor:
    """torchao's symmetric block-wise int8 round trip (absmax / 127 a block of 64)."""
    flat = w.detach().flatten()
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % QB)]).view(-1, QB)
    scale, zero = choose_qparams_affine(flat, MappingType.SYMMETRIC, (1, QB), torch.int8, -127, 127,
                                        scale_dtype=torch.float32)
    q = quantize_affine(flat, (1, QB), scale, zero, torch.int8, -127, 127)
    back = dequantize_affine(q, (1, QB), scale, zero, torch.int8, -127, 127, output_dtype=w.dtype)
    return back.flatten()[:w.numel()].view(w.shape)


def _quantized_reference(model, plan: Plan, bits: int) -> torch.nn.Module:
    """A copy of ``model`` whose frozen matrices are replaced by their round trip, block by block."""
    ref = copy.deepcopy(model)
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for b in plan.graph.blocks:
            mats = [p.name for p in b.params
                    if not p.trainable and p.owner == b.index and quantized_param(p.name, p.shape)]
            if not mats:
                continue
            back = _round_trip_nf4([named[n] for n in mats]) if bits == 4 else \
                [_round_trip_int8(named[n]) for n in mats]
            for n, v in zip(mats, back):
                named[n].copy_(v)
    return ref


@pytest.mark.parametrize("bits,how", [(4, "keep-all"), (4, "recomputed"), (8, "keep-all"),
                                      (4, "resident+gpu-updated")])
def test_qlora_trains_like_peft_eager_on_the_round_tripped_base(bits, how):
    """Losses, gradient norms and the adapters' gradients (each step, as the host store receives them) of a LoRA
    model on a 4- or 8-bit base: PEFT eager's on the base replaced by torchao's round trip, 1e-5 over 3 steps; the
    export reads the dequantized base."""
    model = _lora_model()
    _trains_like_eager(model, _plan(model, how, bits), bits, how)


def test_qlora_with_a_tied_frozen_embedding_reads_it_from_the_packed_owners_raw_section():
    """A model whose head reads the embedding (tied, frozen, kept raw in block 0's packed segment) trains as eager."""
    from test_lora import CFG

    from lazytrain.frontend.lora import ALL_LINEAR, LoraSpec, wrap
    from lazytrain.frontend.presets import build_from_config
    torch.manual_seed(0)
    model = wrap(build_from_config({**CFG, "tie_word_embeddings": True}, device="cpu", dtype=torch.float32),
                 LoraSpec(r=4, alpha=8, targets=ALL_LINEAR))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.02)
    plan = _plan(model, "keep-all", 4)
    assert any(b.params and any(p.owner != b.index for p in b.params) for b in plan.graph.blocks)
    _trains_like_eager(model, plan, 4, "keep-all")


def _trains_like_eager(model, plan: Plan, bits: int, how: str) -> None:
    ref = _quantized_reference(model, plan, bits)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
    assert set(tr.store.quant) == {j for j, lay in enumerate(tr.store.layouts)
                                   if lay.owned_numel > lay.trainable_numel and j not in plan.decisions.resident_blocks}
    trained = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=LR, eps=EPS, weight_decay=0.0)
    compared = train_beside_eager(tr, plan, ref, opt, trained)
    assert compared == 3 * 7 * 2 * (2 if how != "resident+gpu-updated" else 0)
    want = dict(ref.named_parameters())
    for w in trainer_weights(tr):        # the base as the blocks computed with it, the adapters as trained
        if w.name in want:
            torch.testing.assert_close(w.read(), want[w.name].detach(), rtol=1e-5, atol=1e-5)
    tr.close()


def test_the_host_store_and_the_plan_hold_a_frozen_block_packed():
    """The host store's frozen bytes are the packed size (``util.quant_format``); the plan's load of a frozen block
    moves its trainable part in fp32 plus those packed bytes, which the compiler's ``frozen_cost`` gives too; the
    load's GPU transient is the packed staging buffer and the dequantization's temporaries; the load's seconds add
    the dequantization's."""
    model = _lora_model()
    plan = _plan(model, "keep-all", 4)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR), device="cpu")
    sizes, hw = Sizes.of_plan(plan), get_profile("cpu")
    packed = {}
    for j, lay in enumerate(tr.store.layouts):
        frozen = [p for p in plan.graph.blocks[j].params if not p.trainable and p.owner == j]
        q = [p.numel for p in frozen if quantized_param(p.name, p.shape)]
        packed[j] = packed_nbytes(q, sum(p.numel for p in frozen) - sum(q), 4, QB, 4) if frozen else 0
        assert sizes.frozen_host_bytes(j) == packed[j] == frozen_cost(frozen, 4, 4, hw).load_bytes
        if q:
            assert tr.store.packed[j].numel() == packed[j]
            assert tr.store.load[j].numel() == lay.trainable_numel          # the fp32 prefix alone
            assert packed[j] < sum(q) * 4 / 7                               # ~0.52 bytes a value, not 4
    assert tr.store.frozen_nbytes() == sum(packed.values())
    loads = {op.block: op for op in plan.ops if op.kind is OpKind.LOAD}
    b1 = plan.graph.blocks[1]
    assert loads[1].nbytes == b1.trainable_numel * 4 + packed[1]
    assert sizes.dequant_transient(1) > packed[1]
    assert effects(loads[1], sizes).transient == sizes.dequant_transient(1)        # verify's GPU peak counts it
    assert effects(loads[1], Sizes.of_plan(_plan(model, "keep-all", 16))).transient == 0
    cost = CostModel(plan.graph, hw, micro_batch=2, param_dtype="float32", eight_bit=False, base_bits=4)
    assert cost.dequant_s(1) > 0
    assert cost.load_s(1) == pytest.approx(hw.param_load_seconds(loads[1].nbytes) + cost.dequant_s(1))
    tr.close()


def test_a_qlora_checkpoint_records_the_source_base_and_resumes_bit_exact(tmp_path):
    """The base's identity of a 4-bit run is the unquantized values' (a 16-bit run's on the same base); a resume
    quantizes the base again, to the same bytes, and steps on exactly as the run that saved."""
    model = _lora_model()
    plan = _plan(model, "keep-all", 4)
    batches = _batches(4)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")
    packed = {j: b.clone() for j, b in tr.store.packed.items()}
    for ids, labels in batches[:2]:
        tr.step({"input_ids": ids, "labels": labels})
    tr.save_checkpoint(tmp_path / "ckpt")
    want = [tr.step({"input_ids": ids, "labels": labels}).loss for ids, labels in batches[2:]]
    tr.close()
    sixteen = Trainer(_lora_model(), _plan(_lora_model(), "keep-all", 16), optimizer=TorchAdamW(lr=LR), device="cpu")
    from lazytrain.runtime.checkpoint import base_identity
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert meta["base"]["weights_sha256"] == base_identity(sixteen)["weights_sha256"]
    sixteen.close()
    tr2 = Trainer.load_checkpoint(tmp_path / "ckpt", _lora_model(), optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")
    assert all(torch.equal(tr2.store.packed[j], b) for j, b in packed.items())
    got = [tr2.step({"input_ids": ids, "labels": labels}).loss for ids, labels in batches[2:]]
    tr2.close()
    assert got == want


def test_train_with_lora_on_a_4bit_base_runs_and_resumes(tmp_path):
    """``lazytrain train --data ... --lora r=4,alpha=8,targets=q_proj,v_proj --base-bits 4``: 2 steps, then a resume
    to 3 that repeats the first two losses and keeps base_bits."""
    from ft_fixtures import chat, tiny_folder, write_jsonl

    from lazytrain.app.cli import main
    folder = tiny_folder(tmp_path / "hf", tied=False)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(24)])
    out = tmp_path / "run"
    args = ["--batch", "4", "--eval-size", "2", "--policy", "keep-all", "--no-progress", "--device", "cpu",
            "--threads", "1", "--time-limit-min", "2", "--no-eval"]
    assert main(["train", *args, "--model", str(folder), "--data", str(data), "--steps", "2", "--output", str(out),
                 "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--base-bits", "4"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["settings"]["base_bits"] == 4
    meta = json.loads((out / "checkpoint" / "checkpoint.json").read_text())
    assert Plan.from_json(meta["plan"]).options["base_bits"] == 4
    assert main(["train", "--resume", str(out), "--output", str(out), "--steps", "3", "--no-progress", "--device",
                 "cpu", "--threads", "1"]) == 0
    r = json.loads((out / "metrics.json").read_text())
    assert r["steps_done"] == 3 and r["loss_curve"][:2] == m["loss_curve"]
    assert r["settings"]["base_bits"] == 4


def test_a_quantized_base_refuses_a_tied_frozen_matrix_read_by_another_block():
    """A block reading a frozen tied matrix that its owner holds quantized: refused in one line."""
    from lazytrain.runtime.store import BlockLayout, HostStore, Segment
    w = Segment("layers.0.w", 0, 128, (2, 64))
    owner = BlockLayout(0, [w], owned_numel=128, plain_numel=0, trainable=0, grads=0)
    reader_w = Segment("layers.0.w", 4, 128, (2, 64))
    reader = BlockLayout(1, [Segment("a", 0, 4, (4,)), reader_w], owned_numel=4, plain_numel=4, trainable=4, grads=4,
                         links=[(reader_w, 0, 0)])
    HostStore([owner, reader], torch.float32, pin=False)                  # 16 bits: as it was
    with pytest.raises(ValueError, match="which a quantized base holds packed"):
        HostStore([owner, reader], torch.float32, pin=False, base_bits=4)


def test_the_qlora_gpu_script_runs_a_tiny_row_on_the_cpu(tmp_path):
    """benchmarks/qlora_gpu.py --tiny: the 4-bit row in its own process, its JSON and the summary table."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "qlora_gpu.py"
    spec = importlib.util.spec_from_file_location("qlora_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--tiny", "--rows", "lora-nf4", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "lora-nf4.json").read_text())
    assert rows == [row] and "error" not in row, row
    assert row["base_bits"] == 4 and len(row["step_s"]) == 2 and row["tokens_per_s"] > 0
    assert 0 < row["host_frozen_gib"] and row["frozen_params"] > row["trainable_params"]
    assert "lora-nf4" in (tmp_path / "summary.md").read_text()
