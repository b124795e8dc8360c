"""The fused loss head's chunk (``frontend/loss_head.py``): how many logits exist at once, from the GPU budget.

The rule: the largest power of two of logits whose bytes stay within ``LOSS_HEAD_SHARE`` of the GPU budget,
and never more than one sample's logits (``seq_len x vocab``: at micro-batch 1 that is the whole head in one
chunk, and a larger chunk would only be priced, never used).  Why a share and not a search: the chunk buys
nothing but fewer, larger GEMMs, and from a few thousand vocabulary columns on a chunk's matmuls already run
at full rate, while every byte it holds is a byte the MILP cannot spend on kept activations.  The chunk's
cost is in the graph the solver sees: its time in the head's backward FLOPs (the recompute of every chunk's
logits, one forward's worth: ``trace``), its memory as the head's fixed workspace, set here.
"""

from __future__ import annotations

import dataclasses

from ..ir import ModelGraph

#: share of the GPU budget one chunk of logits may take: at 24 GiB (21.3 GiB of budget) that is 2^27 logits,
#: 0.75 GiB in bf16, 4096 vocabulary columns a chunk for 32 x 1024 tokens
LOSS_HEAD_SHARE = 1 / 16


def chunk_logits(head: dict, gpu_bytes: int) -> int:
    """Logits per chunk for the head figures ``head`` (``graph.meta["loss_head"]``) under ``gpu_bytes``."""
    most = head["seq_len"] * head["vocab"]
    room = max(1, int(gpu_bytes * LOSS_HEAD_SHARE) // head["bytes_per_logit"])
    return min(most, 1 << (room.bit_length() - 1))


def with_loss_chunk(graph: ModelGraph, gpu_bytes: int | None) -> ModelGraph:
    """``graph`` with its loss head's chunk chosen for ``gpu_bytes`` (``chunk_logits``): the chunk in
    ``meta["loss_head"]`` (the runtime builds the head with it) and its bytes as the head's fixed workspace.
    A graph without a fused loss head, or without a GPU budget, is returned as it is."""
    head = graph.meta.get("loss_head")
    if not isinstance(head, dict) or not gpu_bytes:
        return graph
    chunk = chunk_logits(head, gpu_bytes)
    j = head["block"]
    blocks = list(graph.blocks)
    blocks[j] = dataclasses.replace(blocks[j], workspace_fixed_bytes=chunk * head["bytes_per_logit"])
    meta = {**graph.meta, "loss_head": {**head, "chunk_logits": chunk}}
    return dataclasses.replace(graph, blocks=tuple(blocks), meta=meta)
