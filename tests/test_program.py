"""The per-block program is the model: chaining its blocks reproduces the model's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lazytrain.frontend.loss_head import fused_next_token_loss
from lazytrain.frontend.presets import build_from_config
from lazytrain.frontend.trace import TraceError, build_program, trace

SEQ, MB = 24, 2


def _hf(model_type: str, tied: bool, **extra) -> dict:
    return {"model_type": model_type, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301, "tie_word_embeddings": tied,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6, **extra}


CONFIGS = {
    "gpt": {"model_type": "lazytrain-gpt", "vocab": 257, "d_model": 64, "n_layer": 6, "n_head": 4, "d_ff": 128,
            "max_seq": 64, "tie_weights": True},
    "gpt-rope": {"model_type": "lazytrain-gpt", "vocab": 257, "d_model": 64, "n_layer": 6, "n_head": 4, "d_ff": 128,
                 "max_seq": 64, "tie_weights": True, "rope": True},
    "qwen2": _hf("qwen2", True),
    "llama": _hf("llama", False),
    "qwen3": _hf("qwen3", False, head_dim=32),
    "mistral-window-8": _hf("mistral", False, sliding_window=8),     # shorter than SEQ: the mask stays
    "mistral-window-64": _hf("mistral", False, sliding_window=64),   # covers SEQ: is_causal, no mask
    "gemma2": _hf("gemma2", True, head_dim=16, sliding_window=8),     # eager attention, softcapping, windows
    "phi3": _hf("phi3", False, pad_token_id=0),
    "granite": _hf("granite", False, logits_scaling=4.0),               # logits / 4 before the loss
    "cohere": _hf("cohere", True, logit_scale=0.5),                    # logits * 0.5 before the loss
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    m = build_from_config(CONFIGS[kind], device="cpu", dtype=torch.float32)
    for p in m.parameters():   # HF inits norms to ones and biases to zeros: perturb so they matter
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    return m


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (MB, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100   # ignored tokens must not count
    return ids, labels


def _chain(prog, params, ids, labels):
    vals = prog.batch_inputs(ids, labels)
    for j in range(prog.graph.n_blocks):
        vals.update(prog.run_block(j, {n: params[n] for n in prog.param_names(j)}, vals))
    return vals["loss_sum"], vals["n_tokens"]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_chain_matches_model(kind, monkeypatch):
    monkeypatch.setattr("lazytrain.ir.graph.LOSS_MIN_COLUMNS", 1)   # the loss head in 64-column vocabulary chunks
    model = _model(kind)
    vocab = CONFIGS[kind].get("vocab", CONFIGS[kind].get("vocab_size"))
    ids, labels = _batch(vocab)
    out = model(ids, labels=labels)
    ref = out if isinstance(out, torch.Tensor) else out.loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # the head in vocabulary chunks with its backward's recompute, then in a single pass of row chunks (2+ each)
    for single_pass in (False, True):
        prog = build_program(model, micro_batch=MB, seq_len=SEQ, device="cpu", dtype=torch.float32,
                             loss_chunk_logits=MB * SEQ * 64, loss_single_pass=single_pass)
        assert prog.graph.n_blocks == 6 + 2
        params = dict(model.named_parameters())
        loss_sum, n_tokens = _chain(prog, params, ids, labels)
        assert int(n_tokens) == int((labels[:, 1:] != -100).sum())
        loss = loss_sum / n_tokens
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        loss.backward()
        for n, p in model.named_parameters():
            # the single pass normalises the softmax by its row sum, eager by its log-sum-exp: fp32 ulps apart
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6 if single_pass else 1e-7,
                                       msg=lambda m, n=n, s=single_pass: f"{n} (single pass {s}): {m}")
        model.zero_grad(set_to_none=True)
    # the program never mutated the model
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_every_parameter_is_in_a_block_and_tied_listed_twice():
    model = _model("qwen2")
    prog = build_program(model, micro_batch=MB, seq_len=SEQ, device="cpu", dtype=torch.float32)
    names = [n for j in range(prog.graph.n_blocks) for n in prog.param_names(j)]
    assert set(names) == {n for n, _ in model.named_parameters()}
    assert names.count("model.embed_tokens.weight") == 2
    assert prog.graph.blocks[-1].params[-1].owner == 0 or any(
        p.owner == 0 for p in prog.graph.blocks[-1].params)


def test_chunked_loss_matches_full_and_chunks(monkeypatch):
    monkeypatch.setattr("lazytrain.ir.graph.LOSS_MIN_COLUMNS", 1)   # 14 rows x 3 columns: 4 vocabulary chunks
    torch.manual_seed(0)
    feats = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7))
    labels[1, 3] = -100
    loss, n = fused_next_token_loss(feats, w, b, labels, 14 * 3)
    logits = feats @ w.t() + b
    ref = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                      ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, ref)
    assert int(n) == 11
    assert torch.autograd.gradcheck(lambda f, w, b: fused_next_token_loss(f, w, b, labels, 14 * 3)[0].double(),
                                    (feats, w, b))
    # the single pass: 3 rows of the whole vocabulary a chunk (5 chunks, the last of 2 rows)
    one = fused_next_token_loss(feats, w, b, labels, 11 * 3, single_pass=True)[0]
    torch.testing.assert_close(one, ref)
    assert torch.autograd.gradcheck(
        lambda f, w, b: fused_next_token_loss(f, w, b, labels, 11 * 3, single_pass=True)[0].double(), (feats, w, b))


def test_sequential_blocks_run_user_loss():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, target = torch.randn(3, 8), torch.randint(0, 4, (3,))
    loss_fn = nn.functional.cross_entropy
    prog = build_program(seq, micro_batch=3, seq_len=1, device="cpu", dtype=torch.float32,
                         example_inputs=(x, target), loss_fn=loss_fn)
    assert prog.graph.n_blocks == 3
    loss_sum, n = _chain(prog, dict(seq.named_parameters()), x, target)
    torch.testing.assert_close(loss_sum / n, loss_fn(seq(x), target))
    g = trace(seq, seq_len=1, dtype="float32", example_inputs=(x, target), loss_fn=loss_fn)
    assert [b.kind for b in g.blocks] == ["other"] * 3 and g.blocks[0].fwd_flops == 2 * 8 * 16


def test_untraceable_model_raises_trace_error():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, input_ids, labels=None):
            if input_ids.sum() > 0:   # data-dependent control flow
                return input_ids.float().sum()
            return self.layers[0](input_ids.float()).sum()

    with pytest.raises(TraceError, match="Bad"):
        trace(Bad(), seq_len=4)


@pytest.mark.parametrize("kind, causal_flag", [("qwen2", True), ("mistral-window-8", False),
                                               ("mistral-window-64", True)])
def test_attention_uses_is_causal_only_where_the_mask_is_plainly_causal(kind, causal_flag):
    from lazytrain.frontend.hf_export import CAUSAL_ATTENTION, use_causal_flag
    from lazytrain.frontend.trace_export import meta_clone
    clone = meta_clone(_model(kind), torch.float32)
    assert use_causal_flag(clone, SEQ) is causal_flag
    assert (clone.config._attn_implementation == CAUSAL_ATTENTION) is causal_flag


def test_a_reduced_clone_copies_only_the_layers_it_keeps():
    import threading

    from lazytrain.frontend.trace_export import meta_clone, reduce_layers
    model = _model("llama")
    reference = reduce_layers(meta_clone(model, torch.bfloat16), 3)
    model.model.layers[3].lock = threading.Lock()        # cannot be deep-copied: layer 3 must never be
    with pytest.raises(TypeError):
        meta_clone(model, torch.bfloat16)
    clone = meta_clone(model, torch.bfloat16, keep=3)
    assert str(clone) == str(reference) and clone.config.num_hidden_layers == 3
    assert [(n, p.shape, p.dtype, p.device.type) for n, p in clone.named_parameters()] == \
        [(n, p.shape, p.dtype, p.device.type) for n, p in reference.named_parameters()]
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6      # the model is untouched
