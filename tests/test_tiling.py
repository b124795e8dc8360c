"""Sequence tiling: layers' position-wise tails in chunks of the sequence, recomputed in backward.

A plan with tiled layers trains exactly as eager PyTorch does (CPU mode, two architectures: Qwen2's
projection + RMSNorm + gated MLP, GPT-2's Conv1D MLP with its flattening views); the trace measures
the tiled program: fewer saved bytes, the tail's forward once more in backward; the compiler tiles only
when no plan fits without, and says so.
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

B, SEQ, TILE, VOCAB = 2, 24, 8, 97
QWEN = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB, "max_position_embeddings": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.mark.parametrize("cfg", [QWEN, GPT2], ids=["qwen2", "gpt2"])
def test_tiled_layers_train_like_eager(cfg):
    torch.manual_seed(0)
    model = build_from_config(dict(cfg), device="cpu", dtype=torch.float32)
    ref = copy.deepcopy(model).train()
    plan = lazytrain.compile(model, batch_size=B, seq_len=SEQ, micro_batch=1, hardware="cpu", gpu_memory="8GiB",
                             host_memory="16GiB", param_dtype="float32", optimizer="adamw", policy="megatrain",
                             seq_tile=TILE)
    assert plan.graph.meta["seq_tile"] == {"tokens": TILE, "blocks": [b.name for b in plan.graph.blocks[1:-1]]}
    assert "in chunks of 8 tokens" in " ".join(plan.summary().split())
    trainer = Trainer(model, plan, optimizer=TorchAdamW(lr=1e-3, eps=1e-6, max_grad_norm=1.0), device="cpu")
    assert all(type(m).__name__ == "TiledTail" for b in trainer.program.blocks[1:-1] for m in b.gm.children())
    step_beside_eager(trainer, ref, random_batches(VOCAB, B, SEQ, 2),
                      lambda m, ids, labels: m(input_ids=ids, labels=labels, use_cache=False).loss, lr=1e-3, eps=1e-6)
    trainer.sync_to_model()
    trainer.close()
    assert_same_parameters(model, ref)


def test_the_trace_measures_the_tiled_program():
    from lazytrain.frontend.trace import trace
    model = build_from_config(dict(QWEN, max_position_embeddings=65536), device="meta")
    seq, tile = 16384, 4096
    plain, tiled = (trace(model, seq_len=seq, seq_tile=t).blocks[1] for t in (None, tile))
    ffn, hidden = QWEN["intermediate_size"], QWEN["hidden_size"]
    # the tail's intermediates are no longer saved: at least the MLP's three (gate, up, their product), bf16
    assert plain.saved_bytes - tiled.saved_bytes >= 3 * seq * ffn * 2
    assert tiled.fwd_flops == plain.fwd_flops
    # backward runs the tail's forward again: its matmuls (o_proj, gate, up, down), 2 FLOPs a weight a token
    tail_weights = hidden * hidden + 3 * hidden * ffn
    assert tiled.bwd_flops - plain.bwd_flops == 2 * tail_weights * seq
    # what the block's backward holds at once (saved + transient) shrinks: one chunk's intermediates, not all
    assert tiled.saved_bytes + tiled.workspace_bytes < 0.65 * (plain.saved_bytes + plain.workspace_bytes)
    assert tiled.fwd_ops > plain.fwd_ops      # each chunk issues the tail's ops


def test_blocks_are_tiled_only_when_no_plan_fits_without(monkeypatch):
    """The rule: ``seq_tile="auto"`` compiles untiled, and tiles only when that raises BudgetError."""
    from lazytrain.compiler import auto_tile
    from lazytrain.compiler.api import BudgetError
    from lazytrain.compiler.auto_tile import compile_auto_tiled
    from lazytrain.compiler.fixed import compile_fixed as real_fixed
    from lazytrain.compiler.request import CompileRequest
    from lazytrain.ir.graph import TILE_TOKENS
    calls = []

    def compile_fixed(model, req):          # the level below the tiling's loop
        calls.append(req.seq_tile)
        if req.seq_tile is None and req.seq_len > 10_000:
            raise BudgetError("needs at least 30 GiB of GPU memory")
        small = CompileRequest.of(model, seq_len=24, hardware="cpu", param_dtype="float32", optimizer="adamw",
                                  policy="megatrain", seq_tile=TILE if req.seq_tile else None)
        return real_fixed(model, small)
    monkeypatch.setattr(auto_tile, "compile_fixed", compile_fixed)
    model = build_from_config(dict(QWEN), device="cpu", dtype=torch.float32)
    short = compile_auto_tiled(model, CompileRequest(seq_len=8192, seq_tile="auto"))
    assert calls == [None] and "seq_tile" not in short.graph.meta
    long_ = compile_auto_tiled(model, CompileRequest(seq_len=65536, seq_tile="auto"))
    assert calls == [None, None, TILE_TOKENS] and long_.graph.meta["seq_tile"]["tokens"] == TILE
    assert "without tiling no plan fits: needs at least 30 GiB" in " ".join(long_.summary().split())


def test_a_bad_tile_size_is_one_line():
    with pytest.raises(ValueError, match="^seq_tile must be a positive number of tokens, 'auto' or None, got 0"):
        lazytrain.compile("tiny", seq_len=64, seq_tile=0)


def test_a_tail_that_draws_random_numbers_is_left_untiled():
    from lazytrain.frontend.program import build_split
    model = build_from_config(dict(GPT2, resid_pdrop=0.1), device="cpu", dtype=torch.float32)
    sp = build_split(model, micro_batch=1, seq_len=SEQ, device="meta", dtype=torch.float32, seq_tile=TILE)
    assert "seq_tile" not in sp.meta
