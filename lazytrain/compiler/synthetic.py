"""Synthetic chains: ModelGraphs with chosen or random costs, for solver tests and brute force."""

from __future__ import annotations

import random

from ..ir import Block, ModelGraph, ParamSpec, TensorSpec


def chain(n_layers: int, *, seed: int | None = None, hidden: int = 1024, seq_len: int = 1024,
          layer_params: int = 50_000_000, saved_per_token: int = 60_000, vocab: int = 32000,
          tied: bool = False) -> ModelGraph:
    """embed + ``n_layers`` layers + head.  With ``seed``, layer costs vary randomly (±50%)."""
    rng = random.Random(seed)
    jit = (lambda: rng.uniform(0.5, 1.5)) if seed is not None else (lambda: 1.0)
    act = TensorSpec(name="hidden", shape=(seq_len, hidden), dtype="bfloat16", requires_grad=True)
    ids = TensorSpec(name="input_ids", shape=(seq_len,), dtype="int64")
    blocks = [Block(index=0, name="embed", kind="embed",
                    params=(ParamSpec(name="embed.weight", shape=(vocab, hidden), owner=0),),
                    inputs=(ids,), outputs=(act,), saved_bytes=seq_len * 8, workspace_bytes=seq_len * hidden * 2,
                    fwd_flops=0, bwd_flops=0)]
    for i in range(1, n_layers + 1):
        p = int(layer_params * jit())
        f = 2 * p * seq_len
        blocks.append(Block(index=i, name=f"layers.{i - 1}", kind="layer",
                            params=(ParamSpec(name=f"layers.{i - 1}.w", shape=(p,), owner=i),),
                            inputs=(act,), outputs=(act,), saved_bytes=int(saved_per_token * seq_len * jit()),
                            workspace_bytes=seq_len * hidden * 8, fwd_flops=int(f * jit()),
                            bwd_flops=int(2 * f * jit())))
    h = n_layers + 1
    head_params = (ParamSpec(name="embed.weight", shape=(vocab, hidden), owner=0),) if tied else (
        ParamSpec(name="lm_head.weight", shape=(vocab, hidden), owner=h),)
    blocks.append(Block(index=h, name="head", kind="head", params=head_params, inputs=(act,), outputs=(),
                        saved_bytes=seq_len * hidden * 4, workspace_bytes=seq_len * 4096 * 4,
                        fwd_flops=2 * vocab * hidden * seq_len, bwd_flops=4 * vocab * hidden * seq_len))
    bb = [ids.nbytes] + [act.nbytes + ids.nbytes] * (n_layers + 1) + [4]
    return ModelGraph(name=f"chain{n_layers}" + (f"-s{seed}" if seed is not None else ""), seq_len=seq_len,
                      dtype="bfloat16", blocks=tuple(blocks), boundary_bytes=tuple(bb),
                      boundary_values=tuple(("input_ids",) if i == 0 else ("hidden", "input_ids")
                                            for i in range(n_layers + 2)) + (("loss",),))
