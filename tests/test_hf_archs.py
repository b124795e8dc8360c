"""Hugging Face architectures whose code differs from Llama's in what the export must handle: Falcon
picks its SDPA code by comparing the attention implementation's name with "sdpa" (so the is_causal flag
must not rename it), indexes with Python lists (``qkv[..., [-2]]``) and builds ALiBi slopes with
``torch.tensor(..., device=...)``, which on the meta trace would lose their values."""

import copy

import pytest
import torch
from eager_ref import assert_same_parameters, random_batches, step_beside_eager

import lazytrain
from lazytrain.frontend.trace_export import export, meta_clone

transformers = pytest.importorskip("transformers")

B, SEQ, VOCAB, STEPS = 4, 16, 67, 3

FALCON = {
    "new-arch-gqa": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "multi-query": {"new_decoder_architecture": False},
    "alibi": {"new_decoder_architecture": False, "alibi": True},
}


def _falcon(variant: str) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "falcon", hidden_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0, **FALCON[variant])
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for p in m.parameters():   # norms at one and biases at zero would hide mistakes
            p.add_(torch.randn_like(p) * 0.02)
    return m


@pytest.mark.parametrize("variant", list(FALCON))
def test_falcon_trains_like_eager(variant):
    model = _falcon(variant)
    ref = copy.deepcopy(model)
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=2, hardware="cpu", param_dtype="float32",
                             optimizer="adamw", policy="megatrain", gpu_memory="8GiB", host_memory="16GiB")
    trainer = lazytrain.Trainer(model, plan, optimizer=lazytrain.optim.TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0),
                                device="cpu")
    step_beside_eager(trainer, ref, random_batches(VOCAB, B, SEQ, STEPS),
                      lambda m, ids, labels: m(input_ids=ids, labels=labels).loss, lr=1e-3, eps=1e-6)
    trainer.sync_to_model()
    # to 1e-5: one weight of the new-architecture variant ends 1.5e-6 from eager on some CPUs (not others): a
    # gradient near Adam's eps, whose ulps (the BLAS's blocking differs by machine) its normalisation lifts
    assert_same_parameters(model, ref, atol=1e-5)
    trainer.close()


def test_model_that_compares_the_attention_name_keeps_its_mask(monkeypatch):
    """A model that asks ``_attn_implementation == "sdpa"`` itself (and would not fail without a mask) is
    exported with its own name and mask, not the is_causal flag (Llama as it is takes the flag:
    test_program's test_attention_uses_is_causal_only_where_the_mask_is_plainly_causal)."""
    from transformers.models.llama import modeling_llama
    forward = modeling_llama.LlamaAttention.forward

    def asking(self, *args, **kwargs):
        self.config._attn_implementation == "sdpa"   # noqa: B015 - the question such a model asks
        return forward(self, *args, **kwargs)

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", asking)
    clone = meta_clone(model, torch.float32)
    ep, _ = export(clone, 2, SEQ)
    assert clone.config._attn_implementation == "sdpa"
    masks = [n.args[3] for n in ep.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(masks) == 3 and all(m is not None for m in masks)


@pytest.mark.parametrize("data, dtype", [
    (0.5, None), ([-2], None), ([[1, 2], [3, 4]], torch.float32), ([True, False], None), ([1.7, -2.2], torch.long),
    ([0.0, -0.0], None), ([], None), (3, torch.bfloat16), (list(range(100)), None)])
def test_tensor_from_python_data_is_torch_tensor(data, dtype):
    """What ``TensorsFromData`` traces for ``torch.tensor(data, dtype=dtype, device=meta)``."""
    from lazytrain.frontend.hf_export import _from_data
    got, want = _from_data(data, dtype, "cpu"), torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(got.float().signbit(), want.float().signbit())


def test_a_loss_without_the_next_token_shift_is_refused():
    """A loss without the next-token shift (BART's decoder as a causal LM) is refused at compile with
    the reason, instead of training something else than eager would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain.frontend.trace_export import TraceError
    kw = dict(batch_size=4, seq_len=16, micro_batch=2, hardware="cpu", param_dtype="float32", optimizer="adamw",
              policy="megatrain", gpu_memory="8GiB", host_memory="16GiB")
    bart = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "bart", d_model=32, decoder_layers=3, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4,
        decoder_ffn_dim=48, encoder_ffn_dim=48, vocab_size=67, max_position_embeddings=64)).float()
    with pytest.raises(TraceError, match="no shift to the next token"):
        lazytrain.compile(bart, **kw)
