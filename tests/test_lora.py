"""LoRA adapters (PEFT) on the streamed schedule (issue #44): a frozen base streams without gradient, optimizer state
or update, and the adapters train exactly as PEFT's eager model does (fp32 on the CPU)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import lazytrain
from lazytrain.compiler.api import Compiler
from lazytrain.compiler.profiles import get_profile
from lazytrain.frontend.lora import ALL_LINEAR, LoraSpec, parse_lora, wrap
from lazytrain.frontend.presets import build_from_config
from lazytrain.frontend.trace import trace
from lazytrain.hf.export import trainer_weights
from lazytrain.ir import Decisions, GiB, ModelGraph, OpKind, Place, Plan, PlanError, Saved, verify
from lazytrain.ir.semantics import frozen_bytes_per_param
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

pytest.importorskip("peft")

B, SEQ = 4, 16
LR, EPS = 1e-3, 1e-6
CFG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67, "tie_word_embeddings": False,
       "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
BUDGETS = dict(gpu_memory="8GiB", host_memory="16GiB")


def _lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    base = build_from_config(CFG, device="cpu", dtype=torch.float32)
    model = wrap(base, LoraSpec(r=4, alpha=8, targets=ALL_LINEAR))
    with torch.no_grad():      # PEFT starts B at zero: perturb it so the adapters' gradients all matter from step 1
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.02)
    return model


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(n):
        ids = torch.randint(0, CFG["vocab_size"], (B, SEQ), generator=g)
        labels = ids.clone()
        labels[0, : 3 + s] = -100
        out.append((ids, labels))
    return out


def _compile(model, policy: str) -> Plan:
    return lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy=policy, **BUDGETS)


#: decisions forcing each way of keeping activations for 4 blocks (embed, 2 layers, head)
FORCED = {"offloaded": ((Place.HOST,) * 4, (Saved.HOST,) * 4),
          "recomputed": ((Place.HOST, Place.HOST, Place.NONE, Place.HOST),
                         (Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.RECOMPUTE, Saved.KEEP)),
          # the adapters' state on the GPU: frozen embedding and layer 1 resident, layer 2 updated on the GPU
          "resident+gpu-updated": ((Place.HOST,) * 4, (Saved.KEEP,) * 4)}


def _plan(model, how: str) -> Plan:
    """keep-all through the compile, else a plan built from ``FORCED`` decisions."""
    if how == "keep-all":
        plan = _compile(model, "keep-all")
        assert not any(op.kind in (OpKind.OFFLOAD, OpKind.RECOMPUTE) for op in plan.ops)
        return plan
    graph = trace(model, seq_len=SEQ, dtype="float32")
    comp = Compiler(graph, get_profile("cpu"), {"gpu_bytes": 8 * GiB, "host_bytes": 16 * GiB}, param_dtype="float32",
                    optimizer="adamw", clip=True)
    boundary, saved = FORCED[how]
    placed = {"resident": (True, True, False, False), "gpu_update": (False, False, True, False)} \
        if how == "resident+gpu-updated" else {}
    plan = comp.build(Decisions(policy=how, micro_batch=2, n_micro=B // 2, boundary=boundary, saved=saved, **placed),
                      B)
    if placed:
        assert plan.decisions.resident_blocks == {0, 1} and plan.decisions.gpu_updated_blocks == {2}
        text = " ".join(plan.summary().split())
        assert "blocks 0-1 (2): " in text and "1 updated on the GPU, the rest frozen" in text
        assert " B trainable, " in text
        assert any(op.kind is OpKind.STATE_LOAD and op.block == 2 for op in plan.ops)
    else:
        kind = OpKind.OFFLOAD if how == "offloaded" else OpKind.RECOMPUTE
        assert any(op.kind is kind for op in plan.ops)
    return plan


def test_parse_lora_spec():
    s = parse_lora("r=16,alpha=32,targets=q_proj,k_proj,v_proj,dropout=0")
    assert s == LoraSpec(r=16, alpha=32.0, targets=("q_proj", "k_proj", "v_proj"), dropout=0.0)
    assert parse_lora({"r": 8, "targets": "all-linear"}).targets == ALL_LINEAR
    assert parse_lora(str(s)) == s and parse_lora(None) is None
    with pytest.raises(ValueError, match="unknown key 'rank'"):
        parse_lora("rank=4")
    with pytest.raises(ValueError, match="r must be a positive integer"):
        parse_lora("r=0")


@pytest.mark.parametrize("how", ["keep-all", "offloaded", "recomputed", "resident+gpu-updated"])
def test_lora_trains_like_peft_eager(how):
    """Losses, gradient norms, the adapters' gradients (each step, as the host store receives them) and the adapters
    as PEFT's eager model with the same AdamW; the base bit-identical."""
    model = _lora_model()
    ref = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    plan = _plan(model, how)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS, max_grad_norm=1.0), device="cpu")
    trained = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=LR, eps=EPS, weight_decay=0.0)
    compared = train_beside_eager(tr, plan, ref, opt, trained)
    assert compared == 3 * 7 * 2 * (2 if how != "resident+gpu-updated" else 0)    # steps x projections x A, B x layers
    tr.sync_to_model()
    tr.close()
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    for n, p in want.items():
        if p.requires_grad:
            torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert torch.equal(got[n], base[n]), n


def test_frozen_base_has_no_gradient_or_update_and_param_dtype_bytes_only():
    """The plan: blocks without trainable parameters (embedding and head here) have no grad_offload and no update;
    the host store: frozen parameters in their load buffer alone, gradients and optimizer state for the adapters."""
    model = _lora_model()
    plan = _compile(model, "keep-all")
    g = plan.graph
    frozen_blocks = [b.index for b in g.blocks if not b.trainable_numel]
    assert frozen_blocks == [0, 3]
    for kind in (OpKind.GRAD_OFFLOAD, OpKind.UPDATE):
        assert sorted(op.block for op in plan.ops if op.kind is kind) == [1, 2], kind
    # r x (in + out) of each adapted projection (q, o; k, v; gate, up, down), two layers
    assert plan.to_json()["model"]["trainable_params"] == g.trainable_params == 2 * 4 * (
        2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 96))
    round_trip = Plan.from_json(plan.to_json())
    assert round_trip.graph.frozen_params == g.frozen_params and round_trip.graph.fingerprint() == g.fingerprint()
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")
    store = tr.store
    for j, lay in enumerate(store.layouts):
        b = g.blocks[j]
        assert store.load[j].numel() == b.owned_numel                 # the whole block, in the parameter dtype
        assert store.grad[j].numel() == b.grad_numel == lay.grad_numel == lay.trainable_numel
        names = [s.name for s in lay.segments]
        assert all("lora_" in n for n in names[:len([p for p in b.params if p.trainable])])
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(t.numel() for t in store.grad) == adapters
    # fp32 plan: every parameter once in its load buffer (4 B), the adapters' gradients (4 B) beside them; nothing else
    assert store.nbytes() == 4 * (g.total_params + adapters) and all(t.dtype == torch.float32 for t in store.load)
    # AdamW's state: master-free fp32 moments for the adapters alone
    state = sum(t.numel() for j in range(len(store.layouts)) if store.layouts[j].trainable_numel
                for t in tr.optimizer.state_tensors(j).values())
    assert state <= 3 * adapters + 16
    # the export's view: frozen values from the load buffers
    weights = {w.name: w.read() for w in trainer_weights(tr)}
    for n, p in model.named_parameters():
        assert torch.equal(weights[n], p.detach()), n
    tr.close()


def test_old_plan_without_trainable_loads_as_all_trainable():
    plan = _compile(_lora_model(), "keep-all")
    d = plan.to_json()
    for b in d["graph"]["blocks"]:
        for p in b["params"]:
            p.pop("trainable", None)      # what a plan written before frozen parameters were recorded holds
    assert all("trainable" not in p for b in d["graph"]["blocks"] for p in b["params"])
    old = ModelGraph.from_json(d["graph"])     # (a plan file checks its fingerprint, which names the frozen ones)
    assert old.frozen_params == 0 and old.trainable_params == plan.graph.total_params


def test_a_plan_with_frozen_parameters_refuses_a_model_that_trains_them():
    model = _lora_model()
    plan = _compile(model, "keep-all")
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.raises(ValueError, match="compiled for another model"):     # (the fingerprint names frozen ones)
        Trainer(model, plan, optimizer=TorchAdamW(lr=LR), device="cpu")


def test_verify_refuses_an_update_of_a_frozen_block():
    plan = _compile(_lora_model(), "keep-all")
    ops = list(plan.ops)
    i = next(op.id for op in ops if op.kind is OpKind.UPDATE and op.block == 1)
    ops[i] = dataclasses.replace(ops[i], block=0)
    with pytest.raises(PlanError, match="block 0 owns no trainable parameters"):
        verify(dataclasses.replace(plan, ops=ops))


@pytest.mark.slow       # a 70B PEFT model built and traced on the meta device: ~15 s, more on a loaded machine
def test_llama3_70b_lora_plan_holds_the_base_in_two_bytes_a_parameter():
    """LoRA r=16 on every linear layer of llama3-70b at 24 GiB GPU / 192 GiB host, batch 16, seq 2048: the host
    store is the bf16 base (2 B a frozen parameter) plus the adapters' state; a full fine-tune needs 8.25 B."""
    from lazytrain.compiler.api import compile_model
    plan = compile_model("llama3-70b", lora="r=16,alpha=32,targets=all-linear", batch_size=16, seq_len=2048,
                         gpu_memory="24GiB", host_memory="192GiB", hardware="h100")
    g = plan.graph
    per_layer = 16 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))    # r x (in + out) a projection
    assert g.frozen_params > 70e9 and g.trainable_params == 80 * per_layer
    base = plan.predicted["host_static_bytes"] - g.trainable_params * plan.options["host_bytes_per_param"]
    assert base / g.frozen_params == pytest.approx(2.0)
    assert plan.predicted["peak_host_bytes"] <= 192 * GiB
    assert sum(op.kind is OpKind.UPDATE for op in plan.ops) == 80       # the layers; embedding and head are frozen


def test_checkpoint_holds_the_adapters_and_resumes_only_on_the_same_base(tmp_path):
    """A LoRA checkpoint: the adapters' masters and state, the base's identity; resumed on the same base it steps on
    as the trainer that saved it; on a changed base it is refused."""
    from safetensors import safe_open
    model = _lora_model()
    plan = _compile(model, "keep-all")
    batches = _batches(4)
    tr = Trainer(model, plan, optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")
    tr.base_source = {"model": "tiny-llama"}
    for ids, labels in batches[:2]:
        tr.step({"input_ids": ids, "labels": labels})
    tr.save_checkpoint(tmp_path / "ckpt")
    want = [tr.step({"input_ids": ids, "labels": labels}).loss for ids, labels in batches[2:]]
    tr.close()
    meta = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert meta["base"]["frozen_params"] == plan.graph.frozen_params and meta["base"]["source"]["model"] == "tiny-llama"
    saved = set()
    for name in meta["files"]:
        with safe_open(str(tmp_path / "ckpt" / name), "pt") as f:
            saved |= {k.removeprefix("param.") for k in f.keys() if k.startswith("param.")}
    assert saved == {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(f["bytes"] for f in meta["files"].values()) < 4 * 4 * len(saved) * 4096       # adapters only

    fresh = _lora_model()               # the base rebuilt from its source, the adapters as PEFT initialises them
    tr2 = Trainer.load_checkpoint(tmp_path / "ckpt", fresh, optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")
    got = [tr2.step({"input_ids": ids, "labels": labels}).loss for ids, labels in batches[2:]]
    tr2.close()
    assert got == want

    other = _lora_model()
    with torch.no_grad():
        other.get_parameter("base_model.model.model.layers.1.mlp.up_proj.base_layer.weight").add_(1e-3)
    with pytest.raises(ValueError, match=r"trained its adapters on another base model \(tiny-llama\)"):
        Trainer.load_checkpoint(tmp_path / "ckpt", other, optimizer=TorchAdamW(lr=LR, eps=EPS), device="cpu")


def test_train_with_lora_on_data_checkpoints_adapters_resumes_and_exports_a_peft_folder(tmp_path):
    """``lazytrain train --data ... --lora ...``: the run trains the adapters only, its checkpoint holds them and the
    base's identity, a resume reads the base from its folder again, and the export is a PEFT adapter folder
    (OUTPUT/adapter/; the merged model and ``lazytrain export`` of it: test_lora_export.py)."""
    from ft_fixtures import chat, tiny_folder, write_jsonl
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lazytrain.app.cli import main
    folder = tiny_folder(tmp_path / "hf")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(f"{i}+{i % 7}=?", f"{i + i % 7}") for i in range(24)])
    out = tmp_path / "run"
    args = ["--batch", "4", "--eval-size", "2", "--policy", "keep-all", "--no-progress", "--device", "cpu",
            "--threads", "1", "--time-limit-min", "2", "--no-eval"]
    assert main(["train", *args, "--model", str(folder), "--data", str(data), "--steps", "2", "--output", str(out),
                 "--lora", "r=4,alpha=8,targets=q_proj,v_proj"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["settings"]["lora"] == {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    meta = json.loads((out / "checkpoint" / "checkpoint.json").read_text())
    assert meta["base"]["source"]["model"] == str(folder) and meta["base"]["source"]["files"]
    for name in meta["files"]:
        with safe_open(str(out / "checkpoint" / name), "pt") as f:
            assert all("lora_" in k for k in f.keys() if k.startswith("param."))
    assert main(["train", "--resume", str(out), "--output", str(out), "--steps", "3", "--no-progress", "--device",
                 "cpu", "--threads", "1"]) == 0
    r = json.loads((out / "metrics.json").read_text())
    assert r["steps_done"] == 3 and r["loss_curve"][:2] == m["loss_curve"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out / "adapter")
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 2 and all(p.abs().sum() > 0 for p in lora_b)     # trained away from PEFT's zero B
    assert not (out / "model").exists()             # (no --merge)


def test_a_frozen_matmul_weight_costs_its_input_gradient_alone_in_backward():
    """The trace counts backward FLOPs as autograd runs them: with the base frozen, a layer's backward is less by
    2 x tokens x the elements of its frozen 2-D weights (their weight gradients), and nothing else changes."""
    from lazytrain.frontend.trace_cache import describe
    model = _lora_model()
    lora = trace(model, seq_len=SEQ, dtype="float32")
    frozen_key = describe(model)
    for p in model.parameters():
        p.requires_grad_(True)
    full = trace(model, seq_len=SEQ, dtype="float32")
    assert describe(model) != frozen_key            # the trace cache tells them apart
    for a, b in zip(lora.blocks, full.blocks):
        weights = sum(p.numel for p in a.params if not p.trainable and len(p.shape) == 2 and a.kind != "embed")
        assert b.bwd_flops - a.bwd_flops == 2 * SEQ * weights, a.name
        assert a.fwd_flops == b.fwd_flops
    assert lora.blocks[1].trainable_numel and not lora.blocks[0].trainable_numel


def test_a_plan_with_a_quantized_base_is_priced_smaller():
    """``base_bits=4``: the compile prices the frozen base at NF4's bytes (host store and loads; the runtime's:
    tests/test_qlora.py)."""
    model = _lora_model()
    full, four = (lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", policy="keep-all",
                                    param_dtype="float32", optimizer="adamw", base_bits=bits, **BUDGETS)
                  for bits in (16, 4))
    g = full.graph
    assert four.options["base_bits"] == 4 and "base_bits" not in full.options
    saved = full.predicted["host_static_bytes"] - four.predicted["host_static_bytes"]
    assert saved == pytest.approx(g.frozen_params * (4 - frozen_bytes_per_param(4, 4)), abs=8)
    loads = [sum(op.nbytes for op in p.ops if op.kind is OpKind.LOAD and op.block == 1) for p in (full, four)]
    assert loads[1] < loads[0] / 4


def test_lora_refuses_several_ranks():
    with pytest.raises(ValueError, match="adapters train on one GPU"):
        lazytrain.compile(_lora_model(), batch_size=B, seq_len=SEQ, hardware="cpu", param_dtype="float32",
                          world_size=2, **BUDGETS)


def test_a_lora_trace_is_cached_with_its_frozen_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_TRACE_CACHE", str(tmp_path / "cache"))
    model = _lora_model()
    first = _compile(model, "keep-all")
    again = _compile(model, "keep-all")
    trace_pass = next(h for h in again.history if h.get("pass") == "trace")
    assert trace_pass.get("cached") and again.graph.frozen_params == first.graph.frozen_params > 0


def test_bench_with_lora_trains_the_same_adapters_in_every_system(tmp_path):
    """``lazytrain bench --lora``: plain PyTorch, FSDP2 and lazytrain train the same adapters on the same base (the
    same losses step after step), and the command line it records repeats the spec."""
    from lazytrain.app.cli import main
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CFG))
    out = tmp_path / "res"
    assert main(["bench", "--model", str(cfg), "--batch", "2", "--seq", "16", "--device", "cpu", "--warmup", "1",
                 "--steps", "3", "--lr", "1e-2", "--gpu-memory", "2GiB", "--systems", "plain,fsdp2,lazytrain-milp",
                 "--out-dir", str(out), "--name", "t", "--lora", "r=4,alpha=8,targets=q_proj,v_proj"]) == 0
    result = json.loads((out / "t.json").read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert not any(r.get("error") for r in rows.values()), [r.get("error") for r in rows.values()]
    for name, r in rows.items():
        assert r["losses"] == pytest.approx(rows["plain"]["losses"], abs=1e-3), name
    assert rows["plain"]["losses"][0] != pytest.approx(rows["plain"]["losses"][-1], abs=1e-4)     # they train
    assert "--lora r=4,alpha=8,targets=q_proj,v_proj" in (out / "t.md").read_text()


def train_beside_eager(tr, plan, ref, opt, trained: dict) -> int:
    """``_batches()`` through the trainer ``tr`` and the eager PEFT model ``ref`` (its trained parameters
    ``trained``, optimizer ``opt``): each step's loss and clipped gradient norm, and the gradients the host-updated
    blocks offload, checked at 1e-5; returns how many gradients were compared."""
    compared = 0
    for ids, labels in _batches():
        stats = tr.step({"input_ids": ids, "labels": labels})
        loss = ref(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        for j, lay in enumerate(tr.store.layouts):     # the host-updated blocks' gradients, as offloaded
            offloaded = tr.store.grad[j].numel() and j not in plan.decisions.gpu_updated_blocks
            for s in lay.segments if offloaded else ():
                if s.offset < lay.grad_numel:
                    got = tr.store.grad[j][s.offset:s.offset + s.numel].view(s.shape)
                    torch.testing.assert_close(got, trained[s.name].grad, rtol=1e-5, atol=1e-5)
                    compared += 1
        norm = torch.nn.utils.clip_grad_norm_(trained.values(), 1.0)
        opt.step()
        torch.testing.assert_close(stats.loss, loss.item(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats.grad_norm, norm.item(), rtol=1e-5, atol=1e-6)
    return compared
