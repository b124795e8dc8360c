"""Rope scaling (what long-context checkpoints use) compiles and trains as eager PyTorch does.

Dynamic NTK and longrope pick their frequencies by the length of the positions at run time, which
``torch.export`` cannot decide on ``meta``; the plan fixes them at its sequence length
(``frontend/rope.py``).  Each case runs below and above the pretrained length (``max_position_embeddings``
16, ``original_max_position_embeddings`` 8 where the type has one), where those types switch, and trains
3 steps beside eager on the CPU (the megatrain policy, so recomputation is checked too).  Linear, YaRN
and llama3 tables are built with the model and traced as they are.
"""

from __future__ import annotations

import copy

import pytest
import torch
from eager_ref import assert_same_parameters, random_batches, step_beside_eager

import lazytrain
from lazytrain.frontend.presets import build_from_config
from lazytrain.runtime.optim.torch_adamw import TorchAdamW
from lazytrain.runtime.trainer import Trainer

pytest.importorskip("transformers")

B, VOCAB = 2, 67
_BASE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 16, "pad_token_id": 0}
SCALINGS = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
                 "long_factor": [2.0, 3.0, 4.0, 5.0], "original_max_position_embeddings": 8},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "linear": {"rope_type": "linear", "factor": 2.0},
}
_PER_LAYER = {"layer_types": ["sliding_attention", "full_attention"], "head_dim": 8, "sliding_window": 8,
              "rope_parameters": {"full_attention": {**SCALINGS["dynamic"], "rope_theta": 10000.0},
                                  "sliding_attention": {**SCALINGS["longrope"], "rope_theta": 10000.0}}}
# ~3 s each (two exports and a Trainer): dynamic NTK past the pretrained length, and per-layer rope
# (Gemma-3: dynamic NTK for full attention, longrope for sliding, in transformers 5's spelling,
# rope_parameters with the theta inside).  Below that length, Phi-3's longrope, and the kinds fixed at
# construction (linear, YaRN, llama3: the buffer path of plain rope): test_length_dependent_tables_...
CASES = {"qwen2-dynamic": ("qwen2", {"rope_scaling": SCALINGS["dynamic"]}),
         "gemma3-dynamic-and-longrope": ("gemma3_text", _PER_LAYER)}
SEQ = 24


def _config(model_type: str, kind: str) -> dict:
    return copy.deepcopy({"model_type": model_type, **_BASE, "rope_scaling": SCALINGS[kind]})


@pytest.mark.parametrize("case", list(CASES))
def test_rope_scaling_trains_like_eager(case):
    model_type, extra = CASES[case]
    torch.manual_seed(0)
    # a deep copy: transformers writes into the rope dicts it is given
    model = build_from_config(copy.deepcopy({"model_type": model_type, **_BASE, **extra}), device="cpu",
                              dtype=torch.float32)
    ref = copy.deepcopy(model).train()
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=1, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy="megatrain")
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0), device="cpu")
    step_beside_eager(trainer, ref, random_batches(VOCAB, B, SEQ, 3),
                      lambda m, ids, labels: m(input_ids=ids, labels=labels, use_cache=False).loss, lr=1e-3, eps=1e-6)
    trainer.sync_to_model()
    trainer.close()
    assert_same_parameters(model, ref)


def test_length_dependent_tables_are_fixed_at_the_plan_length():
    """The tables the plan computes are eager's at that length: the long factors above the pretrained
    length, the short ones below (longrope), and a larger base above it (dynamic NTK)."""
    from lazytrain.frontend.rope import fix_rope_length
    from lazytrain.frontend.trace_export import meta_clone
    for kind, seq, expect in (("longrope", 24, "long"), ("longrope", 8, "short"), ("dynamic", 24, "larger base"),
                              ("dynamic", 8, "as built")):
        model = build_from_config(_config("qwen2", kind), device="cpu", dtype=torch.float32)
        rotary = model.model.rotary_emb
        original = rotary.original_inv_freq.clone()
        clone = meta_clone(model, torch.float32)
        assert fix_rope_length(clone, seq) == ["model.rotary_emb"]
        fixed = clone.model.rotary_emb.inv_freq
        assert fixed.device.type == "cpu" and "inv_freq" not in dict(clone.named_buffers(recurse=True))
        if expect in ("long", "short"):
            factors = torch.tensor(SCALINGS[kind][f"{expect}_factor"])
            short = torch.tensor(SCALINGS[kind]["short_factor"])
            torch.testing.assert_close(fixed, original * short / factors)
        elif expect == "larger base":     # NTK: a larger base, lower frequencies
            assert (fixed < original).any() and (fixed <= original).all()
        else:
            assert torch.equal(fixed, original)
        assert rotary.inv_freq.device.type == "cpu" and torch.equal(rotary.original_inv_freq, original)
    # linear, YaRN, llama3: fixed at construction, nothing to change
    for kind in ("yarn", "llama3", "linear"):
        clone = meta_clone(build_from_config(_config("qwen2", kind), device="cpu"), torch.float32)
        assert fix_rope_length(clone, 24) == []
    # Phi-3 (longrope's usual home) takes the pretrained length from its own field into the rope dict
    phi3 = {"model_type": "phi3", **_BASE, "rope_scaling": dict(SCALINGS["longrope"]),
            "original_max_position_embeddings": 8}
    built = build_from_config(phi3, device="cpu", dtype=torch.float32)
    clone = meta_clone(built, torch.float32)
    assert fix_rope_length(clone, 24) == ["model.rotary_emb"]
    long_, short = (torch.tensor(SCALINGS["longrope"][f"{k}_factor"]) for k in ("long", "short"))
    torch.testing.assert_close(clone.model.rotary_emb.inv_freq * long_,
                               built.model.rotary_emb.original_inv_freq * short)
    # transformers 5's spelling, the theta inside: the same decision
    spelled = {"model_type": "qwen2", **_BASE, "rope_parameters": {**SCALINGS["dynamic"], "rope_theta": 10000.0}}
    clone = meta_clone(build_from_config(spelled, device="cpu"), torch.float32)
    assert fix_rope_length(clone, 24) == ["model.rotary_emb"]
