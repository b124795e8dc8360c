"""Hugging Face architectures beyond the presets: a plan trains them exactly as eager PyTorch does.

Each tiny config goes through ``build_from_config`` (the path of ``lazytrain compile config.json``
and ``lazytrain train --model DIR``), the megatrain policy (every block recomputed, so the
recomputation must equal the forward), two micro-batches, and 3 steps with clipping; losses and
parameters must match eager training to rounding.  Dropout is zeroed here (masks are per micro-batch
in a plan; tests/test_random_replay.py covers dropout).  The MoE models check the routing path (a
``histc`` whose dtype the model picks by device) and in-place writes into fresh buffers (DeepSeek-V3's
attention builds its keys with ``new_empty`` + slice copies).  DeepSeek-V3 runs twice: with one head dimension
for Q, K and V, and with Q and K wider than V, as the real model has them (192 and 128): the trace's attention
then runs another fused kernel on ``meta`` (``trace_export.sdpa``), whose output and V gradient take V's width.
An entry may name its ``model_type`` (several configs of one architecture); else its key is the model type.
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

B, SEQ, VOCAB = 4, 16, 67
_BASE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2}
_GPT2 = {"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64, "resid_pdrop": 0.0,
         "embd_pdrop": 0.0, "attn_pdrop": 0.0}
ARCHS = {
    "gpt2": _GPT2,
    "gpt_neox": {**_BASE, "num_key_value_heads": None},
    "opt": {"hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": VOCAB,
            "max_position_embeddings": 64, "word_embed_proj_dim": 32, "dropout": 0.0, "pad_token_id": 0},
    "bloom": {"hidden_size": 32, "n_layer": 3, "n_head": 4, "vocab_size": VOCAB},
    "phi": _BASE,
    # an encoder family as a causal LM: built as a decoder (is_decoder), so its attention is causal
    "bert": {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
             "num_attention_heads": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "gemma3_text": {**_BASE, "head_dim": 8, "sliding_window": 8},
    "mixtral": {**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**_BASE, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "deepseek_v3": {**_BASE, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8, "n_group": 1, "topk_group": 1},
    # GPT-Neo: alternating global and local (windowed) attention; its config derives the MLP width when none is given
    "gpt_neo": {"hidden_size": 32, "num_layers": 3, "num_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64,
                "attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": 8},
    # hybrids: Qwen3-Next's gated delta-net layers and a full-attention layer (every 4th), one layer class;
    # Jamba's Mamba and attention layers, a class each, in one ModuleList
    "qwen3_next": {**_BASE, "num_hidden_layers": 4, "head_dim": 8, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    "jamba": {**_BASE, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4, "mamba_d_state": 4,
              "mamba_dt_rank": 4},
    # Doge adds a learned bias to the causal mask it builds: its attention must keep the mask (no is_causal flag),
    # and the trace's fused kernel must take a mask that needs a gradient
    "doge": _BASE,
    # twelve layers of two kinds (five windowed to one global): exported as five, each layer running its kind's code
    "gemma3_text-12": {**_BASE, "model_type": "gemma3_text", "num_hidden_layers": 12, "head_dim": 8,
                       "sliding_window": 8},
}
# DeepSeek-V3's multi-head latent attention as the real model shapes it: Q and K heads wider than V's (12 vs 8),
# as many key-value heads as query heads (Hugging Face's SDPA path repeats K and V by the head ratio when their
# widths differ, which a config with fewer key-value heads than its keys have would break in eager too)
ARCHS["deepseek_v3-qk12-v8"] = {**ARCHS["deepseek_v3"], "model_type": "deepseek_v3", "qk_nope_head_dim": 8,
                                "num_key_value_heads": 4}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_trains_like_eager(arch):
    cfg = {"model_type": arch, **{k: v for k, v in ARCHS[arch].items() if v is not None}}
    torch.manual_seed(0)
    model = build_from_config(cfg, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():        # norms start at ones, biases at zeros: perturb so they matter
            p.add_(torch.randn_like(p) * 0.02)
    ref = copy.deepcopy(model).train()
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy="megatrain")
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0), device="cpu")
    step_beside_eager(trainer, ref, random_batches(VOCAB, B, SEQ, 3),
                      lambda m, ids, labels: m(input_ids=ids, labels=labels, use_cache=False).loss, lr=1e-3, eps=1e-6)
    trainer.sync_to_model()
    trainer.close()
    assert_same_parameters(model, ref)


def test_a_model_routed_by_its_data_is_refused_with_what_that_means():
    """DBRX runs only the experts a batch routes to (a loop over the data's expert ids): no one program serves every
    batch, and the error says so rather than only torch.export's guard."""
    from lazytrain.frontend.trace import trace
    from lazytrain.frontend.trace_export import TraceError
    model = build_from_config({"model_type": "dbrx", "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": VOCAB,
                               "max_seq_len": 64, "ffn_config": {"ffn_hidden_size": 48, "moe_num_experts": 4,
                                                                 "moe_top_k": 2},
                               "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}})
    with pytest.raises(TraceError, match="takes a branch or a shape from the values of its tensors"):
        trace(model, seq_len=SEQ)
