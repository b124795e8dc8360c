"""Blocks that draw random numbers (dropout): recomputation replays the forward's draws.

The masks cannot equal eager training's (eager draws them for the whole batch, a plan per
micro-batch), so the check is between plans: one that keeps every activation (backward uses the
forward's masks by construction) and ones that recompute every block must give the same losses,
gradient norms and parameters.  Without the replay they differ (the control case), so the test can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.frontend.trace_export import BlockCode
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

B, SEQ, VOCAB = 4, 16, 67
DROPOUT_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": VOCAB,
                "n_positions": 64, "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.2}
DROPOUT_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
                 "max_position_embeddings": 64, "attention_dropout": 0.3}


def _train(cfg: dict, policy: str, steps: int = 3, device: str = "cpu"):
    torch.manual_seed(0)
    model = build_from_config(cfg, device="cpu", dtype=torch.float32).eval()   # eval: the plan still trains
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy=policy)
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0), device=device)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(123)       # seeds the CUDA generators too
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (B, SEQ), generator=g)
        st = trainer.step({"input_ids": ids, "labels": ids})
        out += [st.loss, st.grad_norm]
    trainer.sync_to_model()
    trainer.close()
    return plan, out, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [DROPOUT_GPT2, DROPOUT_LLAMA], ids=["gpt2", "llama-attn-dropout"])
def test_recomputation_replays_dropout(cfg):
    plan, kept, p_kept = _train(cfg, "keep-all")
    assert plan.decisions.saved and all(s.value == "keep" for s in plan.decisions.saved)
    for policy in ("recompute-all", "megatrain"):
        _, rec, p_rec = _train(cfg, policy)
        assert rec == pytest.approx(kept, rel=1e-6, abs=1e-7), policy
        for n in p_kept:
            torch.testing.assert_close(p_rec[n], p_kept[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_without_replay_recomputation_draws_other_masks(monkeypatch):
    """The control: the same comparison fails when blocks are not marked random."""
    _, kept, _ = _train(DROPOUT_GPT2, "keep-all", steps=1)
    monkeypatch.setattr(BlockCode, "random", property(lambda self: False))
    _, rec, _ = _train(DROPOUT_GPT2, "recompute-all", steps=1)
    assert rec[0] == pytest.approx(kept[0], rel=1e-6)        # the forward draws the same masks
    assert rec[1] != pytest.approx(kept[1], rel=1e-4)        # the backward differentiates other ones


def test_dropout_is_traced_in_training_mode_and_only_when_asked():
    from lazytrain.frontend.program import build_split
    for cfg, random in ((DROPOUT_GPT2, True), ({**DROPOUT_GPT2, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                  "attn_pdrop": 0.0}, False)):
        model = build_from_config(cfg, device="cpu", dtype=torch.float32).eval()
        sp = build_split(copy.deepcopy(model), micro_batch=2, seq_len=SEQ, device="cpu", dtype=torch.float32)
        assert any(b.random for b in sp.blocks) is random
        assert not model.training          # the user's model is left as it was
