"""Packing is exact: several examples a row, positions restarting in each and no attention across them,
give the loss and the gradients of the same examples unpacked (fp32, CPU), through the block program
and through the Trainer; what cannot be packed is refused."""

from __future__ import annotations

import pytest
import torch

import lazytrain
from lazytrain.data import collate, pack_rows
from lazytrain.data.encode import Example
from lazytrain.frontend.trace import build_program
from lazytrain.frontend.trace_export import TraceError

pytest.importorskip("transformers")

LENGTHS = (5, 7, 4, 9, 3, 6)
SEQ = 16


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    extra = {"num_key_value_heads": 2} if model_type != "gemma2" else {"num_key_value_heads": 2, "head_dim": 8}
    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    impl = "eager" if model_type == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).float()


def _examples(all_labels: bool) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        labels = ids if all_labels else [-100] * (n // 2) + ids[n // 2:]      # a prompt, then a completion
        out.append(Example(tuple(ids), tuple(labels), (), "", "t"))
    return out


def _eager_unpacked(model, examples):
    """Loss (mean over labelled tokens) and gradients of the examples, one forward each, unpadded."""
    model.zero_grad()
    total, n = 0.0, 0
    for ex in examples:
        ids, labels = torch.tensor([ex.ids]), torch.tensor(ex.labels)
        logits = model(input_ids=ids).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        n += int((labels[1:] != -100).sum())
    (total / n).backward()
    return (total / n).item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _program_loss(prog, model, batch):
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    env = prog.batch_inputs(batch["input_ids"], batch["labels"], batch.get("position_ids"))
    for j in range(len(prog.blocks)):
        env.update(prog.run_block(j, params, env))
    loss = env["loss_sum"] / env["n_tokens"]
    loss.backward()
    return loss.item(), {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("model_type, all_labels", [("llama", False), ("qwen2", True), ("gemma2", True)])
def test_packed_rows_train_exactly_as_the_examples_unpacked(model_type, all_labels, monkeypatch):
    monkeypatch.setattr("lazytrain.ir.graph.LOSS_MIN_COLUMNS", 1)   # the loss head in 16-column vocabulary chunks
    model = _model(model_type)
    examples = _examples(all_labels)
    rows = pack_rows([len(e) for e in examples], SEQ)
    assert len(rows) < len(examples) and max(len(r) for r in rows) >= 3       # really packed
    batch = collate(examples, SEQ, 0, packed_rows=rows)
    prog = build_program(model, micro_batch=len(rows), seq_len=SEQ, device="cpu", dtype=torch.float32, packed=True,
                         loss_chunk_logits=len(rows) * SEQ * 16)
    loss, grads = _program_loss(prog, model, batch)
    want, want_grads = _eager_unpacked(model, examples)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for k, g in want_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    if model_type != "llama":
        return
    # the same rows without position_ids / the document mask would mix the examples: the test can fail
    plain = build_program(model, micro_batch=len(rows), seq_len=SEQ, device="cpu", dtype=torch.float32)
    mixed, _ = _program_loss(plain, model, {k: v for k, v in batch.items() if k != "position_ids"})
    assert abs(mixed - want) > 1e-3


def test_a_packed_trainer_step_equals_the_unpacked_step():
    model = _model("llama")
    examples = _examples(False)
    rows = pack_rows([len(e) for e in examples], SEQ)
    runs = {}
    for packed in (True, False):
        batch = collate(examples, SEQ, 0, packed_rows=rows) if packed else collate(examples, SEQ, 0)
        b = batch["input_ids"].shape[0]
        plan = lazytrain.compile(model, batch_size=b, seq_len=SEQ, hardware="cpu", gpu_memory="2GiB",
                                 param_dtype="float32", optimizer="adamw", policy="megatrain", packed=packed)
        assert bool(plan.graph.meta.get("packed")) == packed
        opt = lazytrain.optim.TorchAdamW(lr=1e-3, max_grad_norm=1.0)
        with lazytrain.Trainer(model, plan, optimizer=opt, device="cpu", verbose=False) as tr:
            st = tr.step(batch)
            runs[packed] = (st.loss, st.grad_norm, st.tokens, tr.state_dict())
    (lp, gp, tp, wp), (lu, gu, tu, wu) = runs[True], runs[False]
    assert tp == tu
    torch.testing.assert_close(lp, lu, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gp, gu, rtol=1e-5, atol=1e-6)
    for k in wu:
        torch.testing.assert_close(wp[k], wu[k], rtol=1e-5, atol=1e-6)


def test_packing_is_refused_where_it_cannot_be_exact():
    from lazytrain.frontend.presets import build_model
    with pytest.raises(TraceError, match="packing needs a Hugging Face causal LM"):
        build_program(build_model("tiny", device="cpu", dtype=torch.float32), micro_batch=1, seq_len=8,
                      device="cpu", dtype=torch.float32, packed=True)
    model = _model("llama")
    plan = lazytrain.compile(model, batch_size=2, seq_len=8, hardware="cpu", gpu_memory="2GiB", param_dtype="float32",
                             optimizer="adamw", policy="megatrain")
    with lazytrain.Trainer(model, plan, device="cpu", verbose=False) as tr:
        ids = torch.zeros(2, 8, dtype=torch.long)
        with pytest.raises(ValueError, match="position_ids need a plan compiled with packed=True"):
            tr.step({"input_ids": ids, "labels": ids, "position_ids": ids})
